"""The tools' one measuring module: Spearman's rho with ties (scipy's, and the same without scipy), EOS ids, the
model identity a study is keyed on, timing."""
from __future__ import annotations

import random
import sys

import pytest
import torch

from conftest import make_model
from selfspec.tools import measure

TIED = [([1, 2, 2, 3, 4], [1, 3, 2, 2, 5]), ([5, 5, 5, 1, 2, 2], [3, 1, 2, 2, 2, 9]),
        ([0.1, 0.1, 0.3, 0.2], [1.0, 2.0, 2.0, 0.5])]


def _random_tied(seed: int, n: int = 12) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    return [rng.randint(0, 4) for _ in range(n)], [rng.randint(0, 4) for _ in range(n)]


@pytest.mark.parametrize("xs,ys", TIED + [_random_tied(s) for s in range(5)])
def test_spearman_with_ties_equals_scipy_with_and_without_scipy(xs, ys, monkeypatch):
    want = pytest.importorskip("scipy.stats").spearmanr(xs, ys).statistic
    assert measure.spearman(xs, ys) == pytest.approx(want, abs=1e-12)
    monkeypatch.setitem(sys.modules, "scipy.stats", None)  # the fallback: average ranks, then Pearson
    assert measure.spearman(xs, ys) == pytest.approx(want, abs=1e-12)


def test_ties_matter_and_degenerate_inputs_give_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.stats", None)
    xs, ys = [1, 2, 2, 3], [1, 2, 3, 4]
    # ranking tied values by position (what the calibrator's old hand-written Spearman did) gives 1.0 here
    assert measure.spearman(xs, ys) < 0.95
    assert measure.average_ranks([3, 1, 3, 2]) == [3.5, 1.0, 3.5, 2.0]
    assert measure.spearman([1, 2], [2, 1]) is None  # fewer than 3 pairs
    assert measure.spearman([1, 1, 1], [1, 2, 3]) is None  # a constant side has no order


def test_eos_ids_and_identity():
    model = make_model("llama", 2)
    model.generation_config.eos_token_id = [7, 2]

    class Tok:
        eos_token_id = 5

    assert measure.eos_ids_of(model) == [7, 2]  # the generation config's order: its first pads
    assert measure.eos_ids_of(model, Tok()) == [7, 2, 5]
    ident = measure.model_identity(model, "tiny")
    assert ident["model_name"] == "tiny" and ident["num_layers"] == 2 and ident["device"] == "cpu"
    assert len(ident["lm_head_fingerprint"]) == 65  # the fingerprint saved heads are checked against
    assert measure.model_identity(make_model("llama", 2, seed=1), "tiny") != ident  # same shape, other weights


def test_timed_and_environment():
    out, seconds = measure.timed(lambda: 42, torch.device("cpu"))
    assert out == 42 and seconds >= 0
    env = measure.environment("cpu")
    assert {"torch", "transformers", "selfspec", "cpu", "cores", "torch_threads", "device"} <= set(env)
