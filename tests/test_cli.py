"""The `selfspec` command line, end to end in a subprocess on the embedded default model."""
from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "selfspec.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_commands_and_example():
    out = run("--help")
    assert out.returncode == 0
    for word in ("generate", "bench", "calibrate", "train-heads", "example"):
        assert word in out.stdout
    gen = run("generate", "--help")
    assert gen.returncode == 0 and "--max-new-tokens" in gen.stdout and "examples:" in gen.stdout


@pytest.mark.slow
def test_generate_streams_then_prints_stats(smollm2):
    out = run("generate", "--chat", "--max-new-tokens", "12", "Name a prime number.")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()  # the streamed answer
    assert "tok/s" in out.stderr and "mean accepted tokens" in out.stderr and "acceptance rate" in out.stderr


@pytest.mark.slow
def test_generate_sampling_and_bad_model(smollm2, tmp_path):
    out = run("generate", "--sample", "--temperature", "0.7", "--max-new-tokens", "6", "--drafter", "ngram", "Hi")
    assert out.returncode == 0, out.stderr[-2000:]
    bad = run("generate", "--model", str(tmp_path / "missing"), "Hi")
    assert bad.returncode != 0
