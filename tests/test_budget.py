"""`prepare --budget` is a budget: the stages share what is left of it (a resumed run counts the time spent before),
the stages whose cost does not shrink with time are sized to their share, and the report says what was cut."""
from __future__ import annotations

import json

import pytest

from selfspec.tools.calibrate import budget
from selfspec.tools.calibrate.space import MeasureSpec, StrategySpec
from selfspec.training import prepare
from test_prepare import model_dir, write_chats


def run_with(tmp_path, state: dict, budget_text: str = "1000") -> prepare.Run:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / prepare.STATE).write_text(json.dumps(state))
    cfg = prepare.parse_args(["m", "--output", str(out), "--budget", budget_text])
    return prepare.Run(cfg, {"num_layers": 4})


def test_a_resumed_run_splits_what_is_left_among_the_unfinished_stages(tmp_path):
    run = run_with(tmp_path, {"spent_seconds": 450.0, "stages": {"collect": {"done": True, "seconds": 450.0}}})
    left = 1000 - run.spent()
    assert run.allot("train") == pytest.approx(left * 0.25 / 0.55, rel=1e-3)
    assert run.allot("report") == pytest.approx(left * 0.10 / 0.55, rel=1e-3)


def test_a_spent_budget_still_gives_each_stage_its_floor(tmp_path):
    run = run_with(tmp_path, {"spent_seconds": 5000.0, "stages": {}})
    assert run.allot("collect") == prepare.MIN_STAGE_SECONDS


def test_per_stage_budgets_keep_their_own_less_what_they_spent(tmp_path):
    run = run_with(tmp_path, {"spent_seconds": 100.0, "stages": {"train": {"seconds": 100.0}}},
                   "collect=5m,train=10m")
    assert run.allot("train") == 500 and run.allot("collect") == 300 and run.allot("calibrate") is None
    assert run_with(tmp_path, {"stages": {}}, "collect=1s").allot("collect") == 1  # no floor on the user's own


def test_the_report_shrinks_prompts_then_tokens():
    assert prepare.report_size(None, 30.0, 2, 128) == (2, 128)
    assert prepare.report_size(10_000, 30.0, 2, 128) == (2, 128)
    prompts, tokens = prepare.report_size(60, 30.0, 2, 128)  # 72 tokens a category fit
    assert prompts == 1 and tokens == 64
    assert prepare.report_size(1, 30.0, 2, 128) == (1, prepare.REPORT_MIN_TOKENS)


def test_a_calibration_fits_its_setup_and_retiming_into_half_its_budget():
    m, s = MeasureSpec(max_prompts=6, max_new_tokens=40, turns=[1, 2], answer_tokens=128), StrategySpec(
        final_rounds=2, final_candidates=3, final_per_kind=1)
    roomy = budget.fit(m, s, seconds=100_000, per_token=0.04, kinds=5)
    assert roomy.measure == m and roomy.strategy == s and roomy.cut == ""
    tight = budget.fit(m, s, seconds=90, per_token=0.04, kinds=5)
    assert budget.overhead_tokens(tight.measure, tight.strategy, 5) <= budget.SETUP_SHARE * 90 / 0.04
    assert tight.strategy.final_rounds == 1 and tight.strategy.final_per_kind == 0
    assert "re-timing rounds 1 (of 2)" in tight.cut
    floor = budget.fit(m, s, seconds=1, per_token=0.04, kinds=5)  # nothing fits: the smallest setting
    assert (floor.measure.max_prompts, floor.measure.max_new_tokens, floor.measure.turns) == (2, 16, [1])
    # the search gets what is left after setup, less the re-timing and one trial in flight
    left = budget.search_timeout(60, plain_seconds=4.0, m=tight.measure, s=tight.strategy, kinds=5)
    assert 0 < left < 60


@pytest.mark.slow  # the whole command, about half a minute
def test_a_budgeted_run_of_a_base_model_ends_with_what_was_cut_in_its_report(tmp_path):
    """Per-stage budgets on a tiny base model: collection and training stop at their deadlines (far short of
    what was asked for), calibration and the report are sized to theirs, and the report lists every cut."""
    path = model_dir(tmp_path, "llama", chat_template=False)
    out = tmp_path / "out"
    argv = [str(path), "--output", str(out), "--data", str(write_chats(tmp_path / "chats.jsonl", 3000)),
            "--collect-tokens", "10000000", "--steps", "1000000", "--eval-prompts", "2", "--max-new-tokens", "128",
            "--threads", "1", "--dtype", "float32",
            "--budget", "collect=4s,train=4s,calibrate=8s,report=8s"]
    assert prepare.main(argv) == 0
    state = json.loads((out / prepare.STATE).read_text())
    assert state["spent_seconds"] > 0 and state["stages"]["copy"]["budget"] is None  # copy: no limit
    assert all(state["stages"][s]["budget"] for s in ("collect", "train", "calibrate", "report"))
    report = (out / "report.md").read_text()
    assert "What the budget cut:" in report and "- collect:" in report and "- train:" in report, report
    assert "tokens of the 10,000,000 asked for" in report and "steps of the 1,000,000 asked for" in report
