"""The measuring tools that ship as modules run end to end on a tiny model saved as a Hugging Face directory."""
from __future__ import annotations

import pytest

import torch

from conftest import make_model
from tiny_tokenizer import tiny_tokenizer


@pytest.fixture
def tiny_dir(tmp_path):
    """A 2-layer Llama and a tokenizer saved as a Hugging Face directory, as a user's checkpoint would be."""
    make_model("llama", layers=2, dtype=torch.float32).save_pretrained(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    return str(tmp_path / "tiny")


def test_pass_cost_prints_a_ratio_per_pass_size(tiny_dir, capsys):
    from selfspec.tools import pass_cost

    pass_cost.main(["--model", tiny_dir, "--dtypes", "float32", "--tokens", "3", "5", "--cache", "8",
                    "--repeats", "2", "--threads", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| float32 |")]
    assert len(rows) == 1, out
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1].endswith(" ms") and all(c.endswith("x") for c in cells[2:]) and len(cells) == 4, cells
