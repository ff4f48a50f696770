"""No import cycle among selfspec's modules: every import statement (at the top of a module or inside a function,
but not under `if TYPE_CHECKING:`, which never runs) is an edge, and no module reaches itself. And every module and
function stays a size one can read: no file over MAX_LINES lines, no function over MAX_FUNCTION_LINES."""
from __future__ import annotations

import ast
from pathlib import Path

import selfspec

ROOT = Path(selfspec.__file__).parent


def module_names() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _runtime_imports(tree: ast.AST):
    """Import nodes that run: those under `if TYPE_CHECKING:` are left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in _runtime_imports(child))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runtime_imports(node)


def imported(module: str, path: Path, modules: dict) -> set[str]:
    """The selfspec modules `module` imports: `from .a import b` names a.b where that is a module, else a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        found |= {t for t in targets if t in modules and t != module}
    return found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_module_imports_itself_through_others():
    modules = module_names()
    edges = {m: imported(m, p, modules) for m, p in modules.items()}
    assert sum(map(len, edges.values())) > 100  # the walk sees the package's imports
    assert cycles(edges) == []


def test_a_planted_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


MAX_LINES = 600
MAX_FUNCTION_LINES = 80


def too_long(path: Path) -> list[str]:
    """The file itself if it has more than MAX_LINES lines, and its functions (methods and nested ones too) of more
    than MAX_FUNCTION_LINES, decorators and docstring included."""
    text = path.read_text()
    out = [f"{path.name}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_LINES else []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - first + 1 > MAX_FUNCTION_LINES:
                out.append(f"{path.name}:{node.lineno} {node.name}: {node.end_lineno - first + 1} lines")
    return out


def test_no_file_or_function_is_too_long():
    assert [f for path in sorted(ROOT.rglob("*.py")) for f in too_long(path)] == []


def test_a_planted_long_function_is_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    path = tmp_path / "long.py"
    path.write_text(f"@staticmethod\ndef f():\n{body}\n")
    assert too_long(path) == [f"long.py:2 f: {MAX_FUNCTION_LINES + 2} lines"]
