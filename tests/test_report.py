"""The results the README and docs/benchmarks.md show are generated from committed results.json files by the
command each block names, so a page that disagrees with its results fails here."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.tools import report

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_matches_its_results(page):
    text = page.read_text()
    assert report.generated_commands(text), f"{page.name} has no generated results block"
    assert report.regenerate(text, ROOT) == text, (
        f"{page.name} disagrees with its results.json files; run: selfspec bench --update {page.relative_to(ROOT)}")


def test_an_edited_number_is_caught():
    """Negative control: one speedup changed by hand in the README's table no longer matches."""
    text = (ROOT / "README.md").read_text()
    block = text.index(report.BEGIN)
    x = text.index("x |", block)  # the first speedup cell after the block starts
    edited = text[:x - 1] + ("9" if text[x - 1] != "9" else "8") + text[x:]
    assert report.regenerate(edited, ROOT) != edited
    assert report.regenerate(edited, ROOT) == text


def test_update_rewrites_a_stale_page_and_reports_through_the_cli(tmp_path):
    shutil.copytree(ROOT / "docs" / "results" / "cpu-amx", tmp_path / "res")
    page = tmp_path / "page.md"
    page.write_text(f"# x\n\n{report.BEGIN}selfspec bench --report res --brief -->\nstale\n{report.END}\n\nafter\n")
    run = lambda *args: subprocess.run([sys.executable, "-m", "selfspec.cli", "bench", *args], cwd=tmp_path,
                                       capture_output=True, text=True, timeout=120)
    done = run("--update", "page.md")
    assert done.returncode == 0 and "updated page.md" in done.stdout, done.stderr
    text = page.read_text()
    assert "stale" not in text and "| selfspec-hybrid | 1.91x |" in text and text.endswith("after\n")
    assert "up to date" in run("--update", "page.md").stdout
    full = run("--report", "res")
    assert full.returncode == 0 and "| method | tokens/s | speedup" in full.stdout
    assert "--output res`" in full.stdout  # the command that remakes these results, into the folder they are in


def test_a_record_with_prepacked_weights_says_so_and_its_command_still_runs():
    """Records measured with prepacked weights (a speed layer selfspec no longer has) say so, and the command each
    shows leaves out the flag the bench no longer takes."""
    text = report.section("docs/results/cpu-amx", ROOT)
    assert "- weights: prepacked by hand" in text
    assert "--dtype bfloat16 --methods hf-greedy hf-prompt-lookup selfspec" in text
    old = {"meta": {"command": "selfspec bench --limit 4 --pack-weights --methods hf-greedy --output /tmp/x"}}
    assert report.reproducing_command(old, "docs/results/d") == (
        "selfspec bench --limit 4 --methods hf-greedy --output docs/results/d")
    assert "- weights:" not in report.section("docs/results/cpu-avx2", ROOT)  # dense float32: nothing to say


def test_a_differing_output_is_charged_to_its_method():
    """A DIFFER names the method it happened in: in the Qwen record it is Hugging Face's prompt lookup's, and
    selfspec's methods have none."""
    text = report.section("docs/results/cpu-avx512-bf16-qwen2.5-coder-1.5b", ROOT)
    assert "**1 DIFFER** (1 in hf-prompt-lookup)" in text
    assert "none differs" in report.section("docs/results/cpu-avx512-bf16-compiled", ROOT)


def test_bad_report_input_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "selfspec.cli", "bench", "--report", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "results.json does not exist" in done.stderr
    (tmp_path / "results.json").write_text(json.dumps({"records": []}))
    with pytest.raises(ValueError, match="not a `selfspec bench` results file"):
        report.load_results(tmp_path)
