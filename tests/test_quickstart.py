"""A newcomer's path through the README, run as written: the demo's `selfspec generate` answers the question
(chat template, no special tokens), and the README's benchmark slice runs and writes its report. (The Python
blocks, the pipeline call among them, are run by test_readme.py.)"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_command(prefix: str) -> list[str]:
    """The first command line in README.md's bash blocks that starts with `prefix`, comment stripped."""
    text = (ROOT / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            if line.startswith(prefix):
                return shlex.split(line.split("#", 1)[0])
    raise AssertionError(f"README.md has no bash line starting with {prefix!r}")


def demo_command() -> list[str]:
    """The `selfspec generate` line of scripts/demo.sh (the README's first command), without "$@"."""
    line = next(l for l in (ROOT / "scripts" / "demo.sh").read_text().splitlines() if l.startswith("selfspec generate"))
    return [w for w in shlex.split(line) if w != "$@"]


def _run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    exe = [sys.executable, "-m", "selfspec.cli", *argv[1:]]  # the `selfspec` entry point, in this interpreter
    return subprocess.run(exe, cwd=cwd, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_demo_answers_the_question(smollm2, tmp_path):
    argv = demo_command()
    assert argv[:2] == ["selfspec", "generate"]
    done = _run(argv + ["--max-new-tokens", "48", "--threads", "1"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    answer = done.stdout.strip()
    assert answer and "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert "tok/s" in done.stderr  # the stats line
    # an assistant turn, not a continuation of the question: the raw-text run (--no-chat) writes something else
    raw = _run(argv + ["--max-new-tokens", "48", "--threads", "1", "--no-chat"], tmp_path)
    assert raw.returncode == 0 and raw.stdout.strip() != answer


@pytest.mark.slow
def test_readme_benchmark_slice_runs_as_written(smollm2, tmp_path):
    argv = readme_command("selfspec bench")
    done = _run(argv, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    reports = list((tmp_path / "bench_results").glob("*/results.md"))
    assert len(reports) == 1 and "## overall" in reports[0].read_text()
