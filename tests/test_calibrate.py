"""The calibrator: its cost model replays the engine exactly, a planted optimum is found first, an interrupted
study resumes, the written config reproduces plain greedy output, and bad spaces fail before any trial."""
from __future__ import annotations

import json
import os

import pytest
import torch

import selfspec
from conftest import make_model, prompt
from selfspec.drafters import DRAFTERS, ConfidenceRule
from selfspec.tools import cost_model
from selfspec.tools.calibrate import (SEARCH_SPACES, SearchSpec, calibrate, default_space_path, encode_turns,
                                      load_calibration_prompts, load_calibration_texts, load_search_spec, pick_prompts,
                                      resolve_space)

optuna = pytest.importorskip("optuna")

GEN = dict(do_sample=False, pad_token_id=0)
QUIET = dict(log=lambda line: None)


def _prompts(count: int = 2, length: int = 8) -> list[torch.Tensor]:
    return [prompt(seed=10 + s, length=length) for s in range(count)]


def _spec(new_tokens: int = 12, repeats: int = 2, **space) -> SearchSpec:
    """A small, fast search: early exit only, short generations, one final round; `repeats` of each cost-model
    timing (the fastest counts)."""
    return SearchSpec.from_dict({
        "space": {"drafter": ["early_exit"], "max_draft_tokens": {"min": 1, "max": 4},
                  "draft_confidence_threshold": {"min": 0.0, "max": 0.0}, **space},
        "measure": {"max_new_tokens": new_tokens, "warmup_new_tokens": 2, "timing_repeats": repeats},
        # tiny random models seldom beat plain generate; these tests check the search, so the config keeps the
        # winning drafter (the fallback to drafter "none" has its own test)
        "search": {"final_candidates": 2, "final_rounds": 1, "prune_below": 0.0, "plain_if_slower": False},
    })


def _planted_model(layers: int, exit_layer: int):
    """Layers [exit_layer, L) add nothing to the residual stream, so the plain exit at `exit_layer` agrees with
    the full model on every token, and no earlier exit does (a non-agreeable random model)."""
    model = make_model("llama", layers, seed=3, agreeable=False)
    with torch.no_grad():
        for layer in model.model.layers[exit_layer:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def _answers(model, prompts, new_tokens):
    return [model.generate(p, max_new_tokens=new_tokens, **GEN)[0, p.shape[1]:] for p in prompts]


# --- cost model ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("exit_layer,k,quantile,cumulative", [(1, 4, None, False), (3, 2, None, False),
                                                               (2, 6, 0.3, False), (4, 3, 0.6, False),
                                                               (2, 6, 0.05, True), (4, 3, 0.2, True)])
def test_replay_counts_what_the_engine_does(exit_layer, k, quantile, cumulative):
    """simulate() over teacher-forced agreement gives the engine's own steps, drafts and acceptances, with and
    without a confidence threshold (set at a quantile of the head's confidences, so that it bites), judging each
    draft alone or the chain's path (draft_confidence_cumulative)."""
    model = make_model("llama", 6)
    prompts = _prompts(3)
    answers = _answers(model, prompts, 20)
    selfspec.wrap(model, exit_layer=exit_layer, max_draft_tokens=k)
    seqs = [cost_model.Sequence(p, a) for p, a in zip(prompts, answers)]
    acc = cost_model.measure_acceptance(model.selfspec, seqs, [exit_layer])[exit_layer]
    confs = sorted(c for seq in acc.conf for c in seq)
    threshold = 0.0 if quantile is None else confs[int(quantile * len(confs))]
    model.selfspec.config = model.selfspec.config.replace(draft_confidence_threshold=threshold,
                                                          draft_confidence_cumulative=cumulative)
    eos = [[t == 2 for t in a.tolist()] for a in answers]
    counts = cost_model.simulate(acc, eos, k, ConfidenceRule(threshold, cumulative), max_new_tokens=20)
    if cumulative:  # the rules part here, so a drafter that ignored the knob would not match the replay
        assert cost_model.simulate(acc, eos, k, threshold, max_new_tokens=20).drafted > counts.drafted
    engine = dict(steps=0, drafted=0, accepted=0, new=0)
    for p in prompts:
        model.generate(p, max_new_tokens=20, **GEN)
        s = model.selfspec.last_stats
        engine = dict(steps=engine["steps"] + s.verify_steps, drafted=engine["drafted"] + s.drafted_tokens,
                      accepted=engine["accepted"] + s.accepted_tokens, new=engine["new"] + s.new_tokens)
    assert engine == dict(steps=counts.steps + counts.prefills, drafted=counts.drafted, accepted=counts.accepted,
                          new=counts.new_tokens)
    # the comparison can fail: drafts are accepted and rejected (or cut short by the threshold)
    assert 0 < counts.accepted and (counts.accepted < counts.drafted or counts.drafted < counts.draft_passes)


def _answer_ending_in_a_fresh_token(model, index: int, max_new: int):
    """(prompt, its greedy answer without EOS) where answer token `index` occurs nowhere before it, so that making it
    the EOS id ends the answer exactly there."""
    for seed in range(50):
        ids = prompt(seed=seed)
        free = model.generate(ids, max_new_tokens=max_new, **GEN)[0, ids.shape[1]:].tolist()
        if len(free) == max_new and free[index] not in free[:index]:
            return ids, free
    raise AssertionError("no prompt found")


@pytest.mark.parametrize("eos_at", [None, 5, 11])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_replay_has_the_loops_draft_budget(k, eos_at):
    """With every draft right (the oracle), only the loop's draft-length rule decides the steps and drafts: the
    replay (replay.replay_greedy, through cost_model.simulate) must count the engine's exactly, with the answer cut by
    max_new_tokens, ended by an EOS before it, and ended by an EOS on the last allowed token, where the budget (one
    fewer than the tokens left) stops the drafter before the EOS. Negative control: without max_new_tokens the
    replay takes that last answer for one that ended early and counts a draft too many."""
    from selfspec.drafters.oracle import OracleDrafter
    from selfspec.tools.replay import replay_greedy

    max_new = 12
    model = make_model("llama", 4)
    model.generation_config.eos_token_id = None
    ids, free = _answer_ending_in_a_fresh_token(model, 11 if eos_at is None else eos_at, max_new)
    if eos_at is not None:
        model.generation_config.eos_token_id = free[eos_at]
    ref = model.generate(ids, max_new_tokens=max_new, **GEN)[0, ids.shape[1]:].tolist()
    assert len(ref) == (max_new if eos_at is None else eos_at + 1)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=k)
    model.selfspec.drafter_override = OracleDrafter.from_rows([ref])
    assert model.generate(ids, max_new_tokens=max_new, **GEN)[0, ids.shape[1]:].tolist() == ref
    stats = model.selfspec.last_stats
    assert stats.accepted_tokens == stats.drafted_tokens  # the oracle is always right

    drafted = []
    steps = replay_greedy(len(ref), max_new, k, lambda done, budget, _: drafted.append(budget) or budget)
    assert (steps, sum(drafted)) == (stats.verify_steps, stats.drafted_tokens)
    eos = [[t == model.generation_config.eos_token_id for t in ref]]
    sure = cost_model.LayerAcceptance(2, agree=[[True] * len(ref)], conf=[[1.0] * len(ref)])
    counts = cost_model.simulate(sure, eos, k, 0.0, max_new_tokens=max_new)
    assert (counts.steps + 1, counts.drafted, counts.accepted) == (stats.verify_steps, stats.drafted_tokens,
                                                                    stats.accepted_tokens)
    unknown = cost_model.simulate(sure, eos, k, 0.0)  # max_new_tokens not given
    assert unknown.drafted == stats.drafted_tokens + (eos_at == max_new - 1)


def test_accepted_drafts_is_the_loops_acceptance_rule():
    """The replay's host-side rule equals sampling.accepted_prefix, the one greedy and sampled verification use."""
    from selfspec.sampling import accepted_prefix
    from selfspec.tools.replay import accepted_drafts

    g = torch.Generator().manual_seed(0)
    rows = torch.rand(200, 6, generator=g) < 0.7
    lengths = torch.randint(0, 7, (200,), generator=g)
    want = accepted_prefix(rows, lengths).tolist()
    assert [accepted_drafts(r[: n].tolist()) for r, n in zip(rows, lengths.tolist())] == want


def test_acceptance_profile_sees_the_planted_layer():
    model = _planted_model(6, exit_layer=3)
    prompts = _prompts(2)
    selfspec.wrap(model, exit_layer=1)
    seqs = [cost_model.Sequence(p, a) for p, a in zip(prompts, _answers(model, prompts, 16))]
    acc = cost_model.measure_acceptance(model.selfspec, seqs, [1, 2, 3, 5])
    assert acc[3].agreement == 1.0 and acc[5].agreement == 1.0
    assert acc[1].agreement < 0.9 and acc[2].agreement < 0.9  # negative control: earlier exits disagree
    assert acc[3].position_profile(4) == [1.0] * 4


# --- the study -----------------------------------------------------------------------------------------------
class WorkClock:
    """A clock that advances by the work the model does instead of by wall time: every decoder-layer and LM-head
    call costs 1 + ROW_COST per token row it computes. Set as the measuring tools' clock, it makes the costs a
    study measures the planted ones, whatever else runs on the machine."""

    ROW_COST = 0.02

    def __init__(self, model):
        self.now = 0.0
        self.handles = [m.register_forward_hook(self._tick) for m in [*model.model.layers, model.lm_head]]

    def _tick(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        self.now += 1.0 + self.ROW_COST * out.shape[:-1].numel()

    def perf_counter(self) -> float:
        return self.now

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.fixture
def work_clock(monkeypatch):
    """Installs a WorkClock for a model as the clock of selfspec.tools.measure (timed, fastest)."""
    from selfspec.tools import measure

    clocks = []

    def install(model):
        clocks.append(WorkClock(model))
        monkeypatch.setattr(measure, "time", clocks[-1])
        return clocks[-1]

    yield install
    for clock in clocks:
        clock.remove()


def test_planted_optimum_is_found_first(tmp_path, work_clock):
    """With the exit at layer 2 perfect and earlier exits poor, the cheapest perfect setting is E=2 with the
    longest drafts: the cost model enqueues it as trial 0 and the re-timed best is E=2, K=4. The costs are planted
    (WorkClock: a layer call costs about the same for 1 and for 5 tokens), so the search is what is tested.
    (16 new tokens: 1 from the prefill, then 3 steps of 5 with K=4 against 4 steps of 4 with K=3.)"""
    model = _planted_model(6, exit_layer=2)
    clock = work_clock(model)
    spec = _spec(new_tokens=16, repeats=1, exit_layer=[1, 2])
    result = calibrate(model, _prompts(2), spec, output=str(tmp_path), trials=3, **QUIET)
    assert clock.now > 0  # the study's timings ran on the planted clock
    first = result.report["trials"][0]
    params = dict(first["params"])
    params.pop("draft_confidence_cumulative")  # without a threshold either rule drafts K tokens
    assert params == {"drafter": "early_exit", "exit_layer": 2, "max_draft_tokens": 4,
                      "draft_confidence_threshold": 0.0}
    assert first["acceptance_rate"] == 1.0
    assert (result.best.exit_layer, result.best.max_draft_tokens) == (2, 4)
    assert result.report["all_outputs_match_plain"]
    assert result.report["cost_model"]["acceptance_profile"]["2"]["agreement"] == 1.0


def test_work_clock_prices_layers_not_wall_time(work_clock):
    """The planted clock counts what the model computes: a pass over more layers or rows costs more, and the
    same pass costs the same every time."""
    from selfspec.tools.measure import timed

    model = make_model("llama", 4)
    work_clock(model)
    ids = _prompts(1)[0]
    with torch.no_grad():
        _, one = timed(lambda: model(ids[:, :1]))
        _, again = timed(lambda: model(ids[:, :1]))
        _, five = timed(lambda: model(ids[:, :5]))
    assert one == pytest.approx(again) == pytest.approx(5 * (1 + WorkClock.ROW_COST))  # 4 layers, LM head: 1 row
    assert five > one


def test_exactness_tells_a_difference_from_identity():
    """The calibrator's verdict on a trial's outputs: plain generate's own outputs are identical; a token planted
    where the plain model's choice is clear (float64) is a difference, not a near-tie."""
    from selfspec.tools.calibrate.trials import exactness, pad_id_of, time_generation
    from selfspec.tools.verdict import PlainLogits

    model = make_model("llama", 4, agreeable=False)
    prompts = _prompts(2)
    plain = time_generation(model, prompts, 10, plain=True)
    logits = PlainLogits(model, {"pad_token_id": pad_id_of(model)})
    assert exactness(model, logits, prompts, plain.outputs, plain.outputs, 5) == {
        "identical": 2, "near-tie": 0, "differs": 0}
    planted = [o.clone() for o in plain.outputs]
    planted[1][4] = (planted[1][4] + 1) % model.config.vocab_size
    assert exactness(model, logits, prompts, planted, plain.outputs, 5) == {"identical": 1, "near-tie": 0, "differs": 1}


def test_bfloat16_trials_get_a_verdict_not_an_alarm(tmp_path):
    """In bfloat16 an output may part from plain generate at a near-tie of the plain model (its 1-token and
    multi-token passes round differently): every measured trial carries its verdict counts into the report, and
    none differs. (This tiny model's bf16 outputs happen to be identical; the verdict itself is tested above.)"""
    model = make_model("llama", 4, agreeable=False, dtype=torch.bfloat16)
    spec = _spec(new_tokens=24, exit_layer=[2])
    result = calibrate(model, _prompts(3), spec, output=str(tmp_path), trials=3, **QUIET)
    measured = [r for r in result.report["trials"] if r["measured"]]
    assert measured and all(r["differs"] == 0 and r["near_ties"] is not None for r in measured), measured
    ex = result.report["exactness"]
    assert ex["differing_trials"] == 0 and ex["identical_trials"] + ex["near_tie_trials"] == len(measured)
    assert "differ (a bug)" in open(tmp_path / "calibration_report.md").read()


def test_tree_shapes_join_the_study(tmp_path):
    """With trees in the space, tree trials are predicted, measured and exact, and the best tree is kept apart
    from the best chain in per_drafter (the bench's selfspec-tree reads "early_exit-tree")."""
    model = make_model("llama", 4, agreeable=False)
    # every tree suggested is 3 nodes deep 4: the engine raises its size to 4, and so must what is recorded
    spec = _spec(exit_layer=[2], max_draft_tokens=[4], draft_tree_top_k=[1, 3], draft_tree_size=[3])
    result = calibrate(model, _prompts(2), spec, output=str(tmp_path), trials=4, **QUIET)
    trials = [t for t in result.report["trials"] if t.get("measured", True) and "tokens_per_s" in t]
    trees = [t for t in result.report["trials"] if t["params"].get("draft_tree_top_k", 1) > 1]
    assert trees and all("predicted_tokens_per_s" in t for t in trees), result.report["trials"]
    assert result.report["all_outputs_match_plain"], trials
    per = json.load(open(tmp_path / "selfspec_config.json"))["metadata"]["calibration"]["per_drafter"]
    assert per["early_exit-tree"]["draft_tree_top_k"] == 3 and per["early_exit"]["draft_tree_top_k"] == 1
    for params in per.values():  # what the bench runs must be a valid config (a 3-node tree of depth 4 is not)
        selfspec.SelfSpecConfig(**params).validate(num_layers=4)


def test_copy_runs_join_the_study(tmp_path):
    """With a copy head and copy_draft_tokens in the space, chains with and without runs past K are predicted
    (the replay knows the runs), measured and exact; the best chain's entry says which it is, and trees get none."""
    from test_copy_runs import _copy_head, _looping_prompt

    model = make_model("llama", 4)
    selfspec.wrap(model, exit_layer=1)
    model.selfspec.add_head(_copy_head(model.config.hidden_size, model.dtype))
    spec = _spec(exit_layer=[1], max_draft_tokens=[1], copy_draft_tokens=[0, 6], draft_tree_top_k=[1, 2],
                 draft_tree_size=[2])
    prompts = [_looping_prompt(s).to(model.device) for s in range(2)]
    result = calibrate(model, prompts, spec, output=str(tmp_path), trials=5, **QUIET)
    assert result.report["all_outputs_match_plain"], result.report["trials"]
    predicted = {t["params"]["copy_draft_tokens"]: t["predicted_tokens_per_s"] for t in result.report["trials"]
                 if "predicted_tokens_per_s" in t and "copy_draft_tokens" in t["params"]}
    assert set(predicted) == {0, 6} and predicted[0] != predicted[6], result.report["trials"]  # the replay's runs
    per = json.load(open(tmp_path / "selfspec_config.json"))["metadata"]["calibration"]["per_drafter"]
    assert per["early_exit"]["copy_draft_tokens"] in (0, 6) and "copy_draft_tokens" not in per["early_exit-tree"]


def test_hybrid_trees_join_the_study(tmp_path):
    """The hybrid's trees are searched too (measured, not predicted), exact, and kept apart from its chains under
    "hybrid-tree", which the bench's selfspec-hybrid-tree reads."""
    model = make_model("llama", 4, agreeable=False)
    spec = _spec(drafter=["hybrid"], exit_layer=[2], max_draft_tokens=[3], draft_tree_top_k=[1, 2],
                 draft_tree_size=[4], hybrid_min_match=[1], hybrid_policy=["lookup-when-copying"])
    result = calibrate(model, _prompts(2), spec, output=str(tmp_path), trials=4, **QUIET)
    assert result.report["all_outputs_match_plain"], result.report["trials"]
    per = json.load(open(tmp_path / "selfspec_config.json"))["metadata"]["calibration"]["per_drafter"]
    assert per["hybrid-tree"]["draft_tree_top_k"] == 2 and per["hybrid"]["draft_tree_top_k"] == 1, per
    assert per["hybrid"]["hybrid_policy"] == per["hybrid-tree"]["hybrid_policy"] == "lookup-when-copying", per
    for params in per.values():
        selfspec.SelfSpecConfig(**params).validate(num_layers=4)


def test_per_drafter_follows_the_retimed_order():
    """Each drafter's entry is its fastest setting; among the finalists re-timed side by side that order wins over
    the single trial timings, so the config's own (re-timed best) setting is its drafter's entry."""
    from selfspec.tools.calibrate.study import best_per_drafter

    study = optuna.create_study(direction="maximize")
    chain = {"drafter": "early_exit", "exit_layer": 2, "max_draft_tokens": 2, "draft_confidence_threshold": 0.1}
    wide = {**chain, "max_draft_tokens": 1, "draft_tree_top_k": 4, "draft_tree_size": 10}
    deep = {**chain, "max_draft_tokens": 3, "draft_tree_top_k": 4, "draft_tree_size": 4}
    dist = optuna.distributions.CategoricalDistribution([0, 1, 2, 3, 4, 10, 0.1])
    for params, value in ((chain, 30.0), (wide, 33.0), (deep, 34.0)):
        study.add_trial(optuna.trial.create_trial(params=params, distributions={k: (
            optuna.distributions.CategoricalDistribution([v]) if isinstance(v, str) else dist) for k, v in params.items()},
            value=value, user_attrs={"measured": True}))
    assert best_per_drafter(study)["early_exit-tree"]["max_draft_tokens"] == 3  # the trials alone: deep
    confirmed = [{"params": wide}, {"params": deep}]  # re-timed: wide first
    per = best_per_drafter(study, confirmed)
    # a chain is recorded as one that never runs past K, so that a bench starting from a tree-growing config, or
    # from one whose chains copy past K, still runs the chain measured
    assert per["early_exit-tree"] == wide and per["early_exit"] == {**chain, "draft_tree_top_k": 1,
                                                                      "copy_draft_tokens": 0}


def test_resume_adds_trials_to_the_same_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    model = make_model("llama", 4)
    spec = _spec(max_draft_tokens={"min": 1, "max": 2}, exit_layer=[1, 2])
    first = calibrate(model, _prompts(2), spec, storage=storage, study_name="s", trials=2, **QUIET)
    second = calibrate(model, _prompts(2), spec, storage=storage, study_name="s", trials=2, **QUIET)
    study = optuna.load_study(study_name="s", storage=storage)
    measured = [t for t in study.trials if t.user_attrs.get("measured")]
    assert first.report["counts"]["measured"] == 2 and second.report["counts"]["measured"] == 4
    assert len(measured) == 4 and len({json.dumps(t.params, sort_keys=True) for t in measured}) == 4
    assert study.user_attrs["identity"]["num_layers"] == 4
    assert {"torch", "transformers", "selfspec"} <= set(study.user_attrs["environment"])
    other = make_model("llama", 6)  # another model may not write into this study
    with pytest.raises(ValueError, match="another setup"):
        calibrate(other, _prompts(2), spec, storage=storage, study_name="s", trials=1, **QUIET)


@pytest.mark.slow  # a compiled trial compiles every shape of its setting
def test_compiled_trials_go_to_a_study_of_their_own(tmp_path):
    """A compiled step's passes cost less than eager ones: its trials are another setup's. The default study name
    says so, and a study stored without the key (eager, as every one then was) refuses compiled trials."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    model = make_model("llama", 4, dtype=torch.float32)
    spec = _spec(max_draft_tokens={"min": 1, "max": 2}, exit_layer=[1, 2])
    selfspec.wrap(model, compile=True)
    result = calibrate(model, _prompts(2), spec, storage=storage, trials=1, **QUIET)
    assert result.study_name.endswith("-compiled")
    identity = optuna.load_study(study_name=result.study_name, storage=storage).user_attrs["identity"]
    assert identity.pop("compile") is True
    optuna.create_study(study_name="eager", storage=storage).set_user_attr("identity", identity)
    with pytest.raises(ValueError, match=r"another setup \(stored vs now: \{'compile': \(False, True\)\}"):
        calibrate(model, _prompts(2), spec, storage=storage, study_name="eager", trials=1, **QUIET)


def test_a_stored_identity_with_a_removed_speed_layer_is_read(tmp_path):
    """Identities stored by earlier versions may record prepacked weights (`packed`) and a small-row kernel
    (`small_gemm`): a study timed with either on was another setup's and is refused in one line, one timed
    without them resumes."""
    from selfspec.tools.calibrate.study import open_study

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    now = {"model_name": "tiny", "device": "cpu", "dtype": "torch.bfloat16", "folded_gqa": True, "heads": [1],
           "decoding": "greedy"}
    for name, old in (("packed", {"packed": True, "small_gemm": False}), ("kernel", {"packed": True,
                                                                                     "small_gemm": "3-dot"}),
                      ("dense", {"packed": False, "small_gemm": False})):
        optuna.create_study(study_name=name, storage=storage).set_user_attr("identity", {**now, **old})
    with pytest.raises(ValueError, match=r"another setup \(stored vs now: \{'packed': \(True, False\)\}"):
        open_study(storage, "packed", now, seed=0, startup=1)
    with pytest.raises(ValueError, match="another setup"):
        open_study(storage, "kernel", now, seed=0, startup=1)
    assert open_study(storage, "dense", now, seed=0, startup=1).user_attrs["identity"]["packed"] is False


def test_written_config_loads_and_generates_like_plain(tmp_path):
    model = make_model("llama", 4)
    result = calibrate(model, _prompts(2), _spec(), output=str(tmp_path), trials=2, **QUIET)
    assert os.path.isfile(tmp_path / "selfspec_config.json")
    assert (tmp_path / "calibration_report.md").read_text().startswith("# Calibration")
    fresh = make_model("llama", 4)  # same seed, same weights
    ids = prompt(seed=99, length=9)
    ref = fresh.generate(ids, max_new_tokens=24, **GEN)
    selfspec.wrap(fresh, str(tmp_path))
    loaded = fresh.selfspec.config
    assert (loaded.exit_layer, loaded.max_draft_tokens, loaded.drafter) == \
           (result.best.exit_layer, result.best.max_draft_tokens, result.best.drafter)
    assert loaded.metadata["calibration"]["plain_tokens_per_s"] > 0
    out = fresh.generate(ids, max_new_tokens=24, **GEN)
    assert torch.equal(out, ref)
    assert fresh.selfspec.last_stats.drafted_tokens > 0  # it really ran speculatively


def test_a_calibration_nothing_pays_for_writes_a_config_that_drafts_nothing(tmp_path):
    """A random model's exit at layer 3 of 4 drafting 4 tokens a step: each step runs 3 of 4 layers four times and
    a 5-token verify pass for one or two tokens, far slower than plain generate. The config written then drafts
    nothing and says so, the drafter's best stays in per_drafter, and the wrapped model decodes as plain generate
    does; with plain_if_slower off (the negative control) the losing setting is what is written."""
    spec = _spec(max_draft_tokens={"min": 4, "max": 4}, exit_layer=[3])
    spec.search.plain_if_slower = True
    lines = []
    result = calibrate(make_model("llama", 4, agreeable=False), _prompts(2), spec, output=str(tmp_path / "on"),
                       trials=1, log=lines.append)
    assert result.speedup < 1 and result.best.drafter == "none"
    assert any(line.startswith("no setting beat plain generate here") for line in lines)
    calibration = result.best.metadata["calibration"]
    assert calibration["drafting_pays"] is False
    assert calibration["per_drafter"]["early_exit"]["max_draft_tokens"] == 4
    assert "No setting beat plain `generate` here" in (tmp_path / "on" / "calibration_report.md").read_text()
    fresh = make_model("llama", 4, agreeable=False)
    ids = prompt(seed=99, length=9)
    ref = fresh.generate(ids, max_new_tokens=12, **GEN)
    selfspec.wrap(fresh, str(tmp_path / "on"))
    assert torch.equal(fresh.generate(ids, max_new_tokens=12, **GEN), ref)
    assert fresh.selfspec.last_stats.drafted_tokens == 0
    spec.search.plain_if_slower = False
    kept = calibrate(make_model("llama", 4, agreeable=False), _prompts(2), spec, output=str(tmp_path / "off"),
                     trials=1, **QUIET)
    assert kept.speedup < 1 and kept.best.drafter == "early_exit"


def _sampled_spec(temperature: float = 0.8, top_p: float = 0.9) -> SearchSpec:
    spec = _spec(max_draft_tokens={"min": 1, "max": 2}, exit_layer=[1, 2])
    spec.measure = type(spec.measure)(**{**spec.measure.__dict__, "sample": True, "temperature": temperature,
                                         "top_p": top_p})
    return spec


def test_a_sampled_calibration_samples_and_says_so(tmp_path, monkeypatch):
    """With measure.sample every timed generate samples at the spec's temperature and top-p (plain generate too),
    no trial is judged against plain generate's output, the cost model is off, and the study, its default name and
    the written config record the decoding."""
    from transformers import GenerationMixin

    seen = []
    original = GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.append((kwargs.get("do_sample"), kwargs.get("temperature"), kwargs.get("top_p")))
        return original(self, *args, **kwargs)

    import sys

    wrap_module = sys.modules["selfspec.wrap"]  # the module (selfspec.wrap is the function)
    decoded = []
    speculative = wrap_module.speculative_decode

    def spy_speculative(ctx, drafter, ids, mask, settings):
        decoded.append(settings.do_sample)
        return speculative(ctx, drafter, ids, mask, settings)

    monkeypatch.setattr(GenerationMixin, "generate", spy)  # plain generate
    monkeypatch.setattr(wrap_module, "speculative_decode", spy_speculative)  # the trials'
    model = make_model("llama", 4)
    result = calibrate(model, _prompts(2), _sampled_spec(), output=str(tmp_path), trials=2, **QUIET)
    assert seen and set(seen) == {(True, 0.8, 0.9)}, set(seen)
    assert decoded and all(decoded)
    calibration = result.best.metadata["calibration_sampled"]
    assert calibration["decoding"] == "sample, temperature 0.8, top-p 0.9"
    assert result.study_name.endswith("-sampled-temperature0.8-top-p0.9"), result.study_name
    assert result.report["exactness"] is None and result.report["cost_model"] is None
    assert "not compared with plain generate" in (tmp_path / "calibration_report_sampled.md").read_text()
    study = optuna.load_study(study_name=result.study_name, storage=result.storage)
    assert study.user_attrs["identity"]["decoding"] == calibration["decoding"]
    assert not any("matches_plain" in t.user_attrs for t in study.trials)


def test_greedy_and_sampled_calibrations_keep_a_setting_each(tmp_path):
    """A sampled calibration of a greedy-calibrated model writes its winner as the config's `sampling` section and
    its record beside the greedy one; the greedy setting and record stay, and a greedy calibration afterwards keeps
    the sampled ones. Each generate call runs the setting of its decoding mode."""
    model = make_model("llama", 4)
    greedy = calibrate(model, _prompts(2), _spec(max_draft_tokens=[3], exit_layer=[2]), output=str(tmp_path),
                       trials=1, **QUIET).best
    sampled = calibrate(model, _prompts(2), _sampled_spec(), output=str(tmp_path), trials=3, **QUIET).best
    fields = {f: getattr(greedy, f) for f in greedy.__dataclass_fields__ if f not in ("sampling", "metadata")}
    assert {f: getattr(sampled, f) for f in fields} == fields  # the greedy setting, untouched
    assert sampled.metadata["calibration"] == greedy.metadata["calibration"]
    assert sampled.metadata["calibration_sampled"]["decoding"].startswith("sample")
    winner = sampled.metadata["calibration_sampled"]["per_drafter"]["early_exit"]
    assert sampled.for_mode(True).max_draft_tokens == winner["max_draft_tokens"]
    saved = selfspec.SelfSpecConfig.load(str(tmp_path))
    assert saved.sampling == sampled.sampling and (tmp_path / "calibration_report_sampled.md").is_file()
    again = calibrate(model, _prompts(2), _spec(max_draft_tokens=[3], exit_layer=[2]), output=str(tmp_path / "g"),
                      trials=1, **QUIET).best
    assert again.sampling == sampled.sampling and "calibration_sampled" in again.metadata


def test_generate_runs_the_setting_of_its_decoding_mode(monkeypatch):
    """config.sampling replaces the greedy fields when generate samples: the same wrapped model drafts with n-grams
    up to K=4 greedily and with the exit head at K=1 when it samples."""
    import sys

    wrap_module = sys.modules["selfspec.wrap"]
    runs, speculative = [], wrap_module.speculative_decode

    def spy(ctx, drafter, ids, mask, settings):
        runs.append((settings.do_sample, type(drafter).__name__, settings.max_draft_tokens, settings.exit_layer))
        return speculative(ctx, drafter, ids, mask, settings)

    monkeypatch.setattr(wrap_module, "speculative_decode", spy)
    model = make_model("llama", 4)
    selfspec.wrap(model, drafter="ngram", max_draft_tokens=4,
                  sampling={"drafter": "early_exit", "exit_layer": 2, "max_draft_tokens": 1})
    for sample in (False, True):
        model.generate(prompt(seed=1, length=8), max_new_tokens=6, do_sample=sample, pad_token_id=0)
    assert runs == [(False, "NgramDrafter", 4, 4), (True, "EarlyExitDrafter", 1, 2)], runs
    assert model.selfspec.config.drafter == "ngram"  # the engine's own config is not changed by a call


def test_a_study_refuses_another_decoding(tmp_path):
    """Greedy trials and sampled ones are different measurements: a study keeps to the decoding it began with,
    and a study stored before the identity had the key counts as greedy."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    model = make_model("llama", 4)
    greedy = _spec(max_draft_tokens={"min": 1, "max": 2}, exit_layer=[1, 2])
    calibrate(model, _prompts(2), greedy, storage=storage, study_name="s", trials=1, **QUIET)
    with pytest.raises(ValueError, match="decoding"):
        calibrate(model, _prompts(2), _sampled_spec(), storage=storage, study_name="s", trials=1, **QUIET)
    study = optuna.load_study(study_name="s", storage=storage)
    old = {k: v for k, v in study.user_attrs["identity"].items() if k != "decoding"}
    study.set_user_attr("identity", old)  # as studies were stored before
    with pytest.raises(ValueError, match="decoding"):
        calibrate(model, _prompts(2), _sampled_spec(), storage=storage, study_name="s", trials=1, **QUIET)
    calibrate(model, _prompts(2), greedy, storage=storage, study_name="s", trials=1, **QUIET)


# --- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("space,message", [
    ({"exit_layer": [2, 9]}, r"exit_layer includes \[9\].*1\.\.5"),
    ({"exit_layer": {"min": 0, "max": 3}}, r"exit_layer includes \[0\]"),
    ({"max_draft_tokens": {"min": 0, "max": 4}}, r"max_draft_tokens must be >= 1"),
    ({"max_draft_tokens": [2, 0]}, r"max_draft_tokens must be >= 1"),
    ({"draft_confidence_threshold": {"min": 0.5, "max": 1.5}}, r"draft_confidence_threshold needs"),
    ({"drafter": ["early_exit", "magic"]}, r"space.drafter must list"),
    ({"draft_tree_top_k": [0, 2]}, r"draft_tree_top_k must be >= 1"),
    ({"draft_tree_size": {"min": 1, "max": 4}}, r"draft_tree_size must be >= 2"),
    ({"hybrid_policy": ["lookup-first", "head-first"]}, r"space.hybrid_policy must be one or more of"),
    ({"hybrid_policy": []}, r"space.hybrid_policy must be one or more of"),
    ({"draft_confidence_cumulative": "no"}, r"space.draft_confidence_cumulative must be true, false or a list"),
])
def test_bad_space_fails_before_any_trial(tmp_path, space, message):
    model = make_model("llama", 6)
    with pytest.raises(ValueError, match=message):
        calibrate(model, _prompts(1), _spec(**space), output=str(tmp_path / "out"), trials=1, **QUIET)
    assert not (tmp_path / "out" / "study.db").exists()  # no study was opened, nothing was measured


@pytest.mark.parametrize("seed,message", [
    ({"drafter": "early_exit", "exit_layer": 2, "max_draft_tokens": 7}, r"search.enqueue\[0\] \(early_exit E=2 K=7\) "
                                                                         r"lies outside the space"),
    ({"exit_layer": 2}, r"search.enqueue\[0\] must be a setting with a 'drafter'"),
])
def test_a_seed_outside_the_space_fails_before_any_trial(tmp_path, seed, message):
    model = make_model("llama", 6)
    spec = _spec()
    spec.search.enqueue = [seed]
    with pytest.raises(ValueError, match=message):
        calibrate(model, _prompts(1), spec, output=str(tmp_path / "out"), trials=1, **QUIET)
    assert not (tmp_path / "out" / "study.db").exists()


def test_a_seed_at_an_exit_the_heads_lack_is_left_out_where_exits_are_the_heads(tmp_path):
    """A shipped space seeds the shipped heads' exit layer; heads trained at another layer (exit_layer: auto) are
    calibrated without that seed, with a line saying so. A space that names its exit layers still refuses it."""
    from selfspec.heads import ExitHead

    model = make_model("llama", 6)
    selfspec.wrap(model, exit_layer=3)
    model.selfspec.add_head(ExitHead(3))
    seed = {"drafter": "early_exit", "exit_layer": 1, "max_draft_tokens": 2}
    spec = _spec(exit_layer="auto")
    spec.search.enqueue, spec.search.enqueue_top = [seed], 1
    lines = []
    result = calibrate(model, _prompts(1), spec, output=str(tmp_path / "a"), trials=1, log=lines.append)
    assert any("search.enqueue[0] (early_exit E=1 K=2) drafts at exit layer 1, where these heads have none" in line
               for line in lines), lines
    assert not [t for t in result.report["trials"] if t.get("enqueued_by") == "space_file"]
    spec = _spec(exit_layer=[3])
    spec.search.enqueue = [seed]
    with pytest.raises(ValueError, match=r"search.enqueue\[0\] \(early_exit E=1 K=2\) lies outside the space"):
        calibrate(model, _prompts(1), spec, output=str(tmp_path / "b"), trials=1, **QUIET)


def test_unknown_space_names_the_shipped_ones():
    with pytest.raises(FileNotFoundError, match=r"smollm2-135m"):
        load_search_spec("no-such-space")


def test_unknown_yaml_key_is_named(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("space:\n  exit_layers: [1, 2]\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['exit_layers'\] in space"):
        load_search_spec(path)


@pytest.mark.parametrize("name", ["default", "smollm2-135m"])
def test_shipped_spaces_resolve_for_smollm2(name):
    """The search spaces ship inside the package (an installed wheel has no configs/): by name, by path, and as
    the default for a model that has one (else default.yaml)."""
    spec = load_search_spec(name)
    assert spec.to_dict() == load_search_spec(SEARCH_SPACES / f"{name}.yaml").to_dict() | {"source": spec.source}
    assert default_space_path(name) == SEARCH_SPACES / f"{name}.yaml"
    assert default_space_path("some-org/other-model") == SEARCH_SPACES / "default.yaml"
    space = resolve_space(spec, num_layers=30, head_layers=[], registered=DRAFTERS)
    assert space.exit_layers == list(range(1, 30)) and space.max_draft_tokens[0] >= 1
    assert space.drafters[0] == "early_exit"
    assert resolve_space(spec, 30, [6, 12], DRAFTERS).exit_layers == [6, 12]  # heads only when trained


# --- prompts -------------------------------------------------------------------------------------------------
def test_prompt_files(tmp_path):
    jsonl = tmp_path / "q.jsonl"
    rows = [{"category": c, "turns": [f"{c} {i}", "second turn"]} for c in ("writing", "qa", "math") for i in (1, 2)]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert load_calibration_texts(str(jsonl), 3) == ["writing 1", "math 1", "writing 2"]  # qa is evaluation
    text = tmp_path / "p.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert load_calibration_texts(str(text), 5) == ["first prompt", "second prompt"]
    default = load_calibration_texts(None, 8)  # Spec-Bench train split: one per MT-bench category
    assert len(default) == 8 and len(set(default)) == 8
    assert pick_prompts([("a", "1"), ("a", "2"), ("b", "3")], 2) == ["1", "3"]


def test_calibration_prompts_keep_their_turns(tmp_path):
    jsonl = tmp_path / "q.jsonl"
    rows = [{"category": c, "turns": [f"{c} 1", f"{c} again"]} for c in ("writing", "qa", "math")]
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    picked = load_calibration_prompts(str(jsonl), 5)
    assert [p.turns for p in picked] == [("writing 1", "writing again"), ("math 1", "math again")]
    assert all(len(p.turns) == 2 for p in load_calibration_prompts(None, 8))  # MT-bench: two turns each


def _chat_model(tok):
    """A tiny Llama over the tiny tokenizer's ids, whose greedy text varies (peaky logits)."""
    import transformers as tf

    torch.manual_seed(4)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model.double().eval()


def test_second_turns_carry_the_models_own_first_answer():
    """measure.turns [1, 2]: the first turns as they are, then each two-turn question as [first turn, the plain
    model's greedy answer to it, second turn] in the chat template, as Spec-Bench runs MT-bench; a one-turn prompt
    gives its first turn only."""
    from selfspec.prompts import Prompt, chat_input_ids, conversation_ids
    from selfspec.tools.calibrate.space import MeasureSpec
    from tiny_tokenizer import tiny_tokenizer

    tok = tiny_tokenizer()
    model = _chat_model(tok)
    selfspec.wrap(model, exit_layer=2)  # the answer is plain generate's, wrapped or not
    prompts = [Prompt("Name a fruit.", "writing", 1, ("Name a fruit.", "Now a colour.")), Prompt("Just one turn.")]
    got = encode_turns(model, tok, prompts, MeasureSpec(turns=[1, 2], answer_tokens=12), "cpu")
    assert len(got) == 3
    assert torch.equal(got[0], chat_input_ids(tok, "Name a fruit.")) and torch.equal(got[1], chat_input_ids(
        tok, "Just one turn."))
    first = chat_input_ids(tok, "Name a fruit.")
    plain = selfspec.unwrap(model).generate(first, attention_mask=torch.ones_like(first), max_new_tokens=12,
                                            do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(plain[0, first.shape[1]:], skip_special_tokens=True)
    assert answer.strip()  # a real answer, so a second turn without it would differ
    want = conversation_ids(tok, [{"role": "user", "content": "Name a fruit."},
                                  {"role": "assistant", "content": answer},
                                  {"role": "user", "content": "Now a colour."}])
    assert torch.equal(got[2], want)
    assert len(encode_turns(model, tok, prompts, MeasureSpec(turns=[2], answer_tokens=12), "cpu")) == 1
    for turns in ([2], [1, 2]):  # single-turn prompts: their first turns are timed, and the log says so once
        said = []
        got = encode_turns(model, tok, prompts[1:], MeasureSpec(turns=turns), "cpu", log=said.append)
        assert len(got) == 1 and torch.equal(got[0], chat_input_ids(tok, "Just one turn."))
        assert len(said) == 1 and said[0].startswith("calibrating on first turns: no calibration prompt has a second")


@pytest.mark.parametrize("turns", [[], [3], [1, 1], "1"])
def test_measure_turns_are_checked(turns):
    from selfspec.tools.calibrate.space import MeasureSpec

    with pytest.raises(ValueError, match="measure.turns must list 1, 2 or both"):
        MeasureSpec(turns=turns)


@pytest.mark.parametrize("k,top_k,size", [(3, 2, 8), (4, 3, 9), (5, 4, 6), (2, 4, 16)])
def test_tree_shape_is_what_the_drafter_grows(monkeypatch, k, top_k, size):
    """The cost model's tree (cost_model.tree_shape) has the widths and node count of the trees the drafter
    grows (threshold 0, full depth budget), since both read drafters.tree.frontier_width."""
    import selfspec.drafters.early_exit as early_exit

    grown, original = [], early_exit.grow_tree

    def spy(state, run_level, depth, *args):
        draft = original(state, run_level, depth, *args)
        grown.append((depth, draft.hidden.shape[1], draft.tokens.shape[1]))
        return draft

    monkeypatch.setattr(early_exit, "grow_tree", spy)
    model = make_model("llama", 4)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=k, draft_tree_top_k=top_k, draft_tree_size=size)
    model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=16, **GEN)
    widths, nodes = cost_model.tree_shape(k, top_k, size)
    full = [(run, n) for depth, run, n in grown if depth == k]
    assert full and set(full) == {(sum(widths), nodes)}, (grown, widths, nodes)


def test_tree_replay_with_a_sure_head_accepts_the_whole_depth():
    """A head whose top choice is always right: a tree accepts as much as the chain, drafting its whole shape."""
    n, k = 30, 4
    sure = cost_model.LayerAcceptance(2, agree=[[True] * n], conf=[[1.0] * n], rank=[[0] * n], prob=[[1.0] * n])
    eos = [[False] * n]
    chain = cost_model.simulate(sure, eos, k, 0.0, max_new_tokens=n)
    tree = cost_model.simulate_tree(sure, eos, k, 3, 10, 0.0, max_new_tokens=n)
    assert (tree.steps, tree.accepted, tree.new_tokens) == (chain.steps, chain.accepted, chain.new_tokens)
    widths, nodes = cost_model.tree_shape(k, 3, 10)
    assert tree.verify_width[nodes + 1] >= tree.steps - 2  # all but the budget-cut last steps draft the whole tree
    # the answer's token always second in the head's ranking: a chain gets nothing, a tree with 2 children two a
    # step: the all-second path is its level's least likely (0.4 x 0.4 against 0.5 x 0.5 and 0.5 x 0.4 twice), so
    # the grower runs it no further than depth 1 and keeps its depth-2 node only as a leaf
    second = cost_model.LayerAcceptance(2, agree=[[False] * n], conf=[[0.5] * n], rank=[[1] * n],
                                        prob=[[0.4] * n])
    both = cost_model.simulate_tree(second, eos, k, 2, 8, 0.0, max_new_tokens=n)
    assert 2 * (both.steps - 1) <= both.accepted <= 2 * both.steps, both
    assert cost_model.simulate(second, eos, k, 0.0, max_new_tokens=n).accepted == 0
    # a threshold the head's 0.5 reaches once but not twice stops growth after one run level; the tree's leaves
    # at depth 2 would hold the answer's token, but its path's probability (0.4 x 0.4) is below the threshold,
    # so the grower leaves them out: one draft a step at most (without that rule: two)
    stopped = cost_model.simulate_tree(second, eos, k, 2, 8, 0.3, max_new_tokens=n)
    assert stopped.accepted <= stopped.steps + 1, stopped
    # and the verifier sees the 2 run nodes and the root only (all but the budget-cut last steps)
    assert stopped.verify_width.get(3, 0) >= stopped.steps - 2, stopped
    loose = cost_model.simulate_tree(second, eos, k, 2, 8, 0.15, max_new_tokens=n)  # 0.16 reaches 0.15
    assert loose.steps < loose.accepted <= 2 * loose.steps + 2, loose


def test_a_study_refuses_other_heads_at_the_same_layers(tmp_path):
    """Trials measured with one head must not be mixed with trials of a retrained head at the same layer."""
    from selfspec.heads import MLPHead

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    model = make_model("llama", 4)
    spec = _spec(max_draft_tokens={"min": 1, "max": 2}, exit_layer=[2])
    for seed in (0, 1):
        selfspec.wrap(model, exit_layer=2)
        torch.manual_seed(seed)
        model.selfspec.add_head(MLPHead(2, 32, 48).double())
        if seed == 0:
            calibrate(model, _prompts(2), spec, storage=storage, study_name="s", trials=1, **QUIET)
        else:
            with pytest.raises(ValueError, match="head_weights"):
                calibrate(model, _prompts(2), spec, storage=storage, study_name="s", trials=1, **QUIET)
        selfspec.unwrap(model)


def test_a_top_reading_head_calibrates(tmp_path):
    """The cost model times and replays a head that reads final states; its chain and tree trials stay exact."""
    from test_heads import _heads

    model = make_model("llama", 4)
    selfspec.wrap(model, exit_layer=2)
    model.selfspec.add_head(_heads()["mlp-top"])
    try:
        spec = _spec(exit_layer=[2], max_draft_tokens=[3], draft_tree_top_k=[1, 2], draft_tree_size=[4])
        result = calibrate(model, _prompts(2), spec, output=str(tmp_path), trials=3, **QUIET)
        assert result.report["all_outputs_match_plain"] and result.report["counts"]["measured"] >= 2
    finally:
        selfspec.unwrap(model)


@pytest.mark.parametrize("balance", [True, False])
def test_every_kind_of_drafting_gets_trials(balance):
    """Where one kind wins by far (here hybrid), TPE alone spends nearly every trial on it, and the chain's and the
    tree's bests (what bench runs for them) come from a trial or two; with balance_kinds every other trial goes to
    the kind with the fewest. The objective stands in for timing only: what is tested is the search's choices."""
    from selfspec.tools.calibrate.space import suggest, tree_key
    from selfspec.tools.calibrate.study import BalanceKinds

    spec = SearchSpec.from_dict({"space": {"drafter": ["early_exit", "ngram", "hybrid"], "exit_layer": [1, 2],
                                           "draft_tree_top_k": [1, 2, 3]}})
    space = resolve_space(spec, 4, [1, 2], DRAFTERS)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=5))

    def landscape(trial):
        params = suggest(trial, space)
        return (100.0 if params["drafter"] == "hybrid" else 10.0) + params["max_draft_tokens"]

    study.optimize(landscape, n_trials=40, callbacks=[BalanceKinds(space)] if balance else [])
    kinds = ("early_exit", "early_exit-tree", "ngram", "hybrid", "hybrid-tree")  # both exit drafters grow trees
    count = {k: sum(tree_key(t.params) == k for t in study.trials) for k in kinds}
    fewest = min(count.values())
    assert (fewest >= 5) == balance, count


def test_a_recalibration_measures_the_previous_bests_again(tmp_path):
    """The per_drafter bests recorded in the heads' config are enqueued and measured again (those the space can
    suggest: here the hybrid's exit layer is outside it), so a study over new heads starts from what won before."""
    model = make_model("llama", 4, agreeable=False)
    before = {"early_exit": {"drafter": "early_exit", "exit_layer": 2, "max_draft_tokens": 3,
                             "draft_confidence_threshold": 0.0, "draft_tree_top_k": 1},
              "hybrid": {"drafter": "hybrid", "exit_layer": 3, "max_draft_tokens": 2}}
    selfspec.wrap(model, exit_layer=2, metadata={"calibration": {"per_drafter": before}})
    lines = []
    spec = _spec(exit_layer=[1, 2], drafter=["early_exit", "hybrid"])
    spec.search.enqueue_top = 1
    result = calibrate(model, _prompts(2), spec, output=str(tmp_path), trials=3, log=lines.append)
    assert any(line.startswith("enqueued 1 previous best(s): early_exit E=2 K=3") for line in lines), lines
    again = [t for t in result.report["trials"] if t.get("enqueued_by") == "previous_calibration"]
    assert len(again) == 1 and again[0]["measured"], again
    assert {k: again[0]["params"][k] for k in ("exit_layer", "max_draft_tokens")} == {"exit_layer": 2,
                                                                                      "max_draft_tokens": 3}


def test_the_space_files_seeds_are_measured_first(tmp_path):
    """search.enqueue: a hand-set setting is queued ahead of the sampler's and measured as given."""
    model = make_model("llama", 4, agreeable=False)
    selfspec.wrap(model, exit_layer=2)
    seed = {"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 3, "draft_confidence_threshold": 0.0,
            "ngram_max": 2, "hybrid_min_match": 1, "hybrid_policy": "lookup-when-unsure",
            "draft_confidence_cumulative": False}
    spec = _spec(exit_layer=[1, 2], drafter=["early_exit", "hybrid"])
    spec.search.enqueue, spec.search.enqueue_top = [seed], 1
    lines = []
    result = calibrate(model, _prompts(2), spec, output=str(tmp_path), trials=2, log=lines.append)
    assert any(line.startswith("enqueued 1 setting(s) of the space file: hybrid E=1 K=3") for line in lines), lines
    (seeded,) = [t for t in result.report["trials"] if t.get("enqueued_by") == "space_file"]
    assert seeded["measured"] and seeded["params"] == seed, (seeded, lines)


def test_the_final_comparison_retimes_each_kinds_best():
    """final_per_kind: besides the overall best, each kind's best measured settings are re-timed, so that every
    per_drafter entry comes from the side-by-side timing; without it only the overall best are."""
    from selfspec.tools.calibrate.space import StrategySpec
    from selfspec.tools.calibrate.study import best_per_drafter, final_candidates

    study = optuna.create_study(direction="maximize")
    ngram = {"drafter": "ngram", "max_draft_tokens": 3, "ngram_max": 2}
    settings = [(ngram, 40.0), ({**ngram, "max_draft_tokens": 4}, 39.0), ({**ngram, "ngram_max": 3}, 38.0),
                ({"drafter": "early_exit", "exit_layer": 1, "max_draft_tokens": 4}, 30.0),
                ({"drafter": "early_exit", "exit_layer": 1, "max_draft_tokens": 5}, 29.5),
                ({"drafter": "hybrid", "exit_layer": 1, "max_draft_tokens": 4}, 35.0)]
    for params, value in settings:
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: optuna.distributions.CategoricalDistribution([v]) for k, v in
                                          params.items()}, value=value, user_attrs={"measured": True}))
    values = lambda trials: sorted(t.value for t in trials)
    assert values(final_candidates(study, StrategySpec(final_candidates=2))) == [39.0, 40.0]
    picked = final_candidates(study, StrategySpec(final_candidates=2, final_per_kind=2))
    assert values(picked) == [29.5, 30.0, 35.0, 39.0, 40.0]  # ngram's third is neither
    # the re-timing reorders the chain's two: its per_drafter entry follows it, not the single trials
    confirmed = [{"params": p.params} for p in sorted(picked, key=lambda t: t.params.get("max_draft_tokens"))]
    assert best_per_drafter(study, confirmed[::-1])["early_exit"]["max_draft_tokens"] == 5


def test_previous_bests_from_before_the_path_rule_are_measured_with_the_rule_they_ran():
    """A per_drafter chain recorded before draft_confidence_cumulative existed ran the per-draft rule: it is queued
    with cumulative false, not left to the sampler (which could measure the old best with the other rule)."""
    from selfspec.config import SelfSpecConfig
    from selfspec.tools.calibrate.study import enqueue_previous

    old = {"drafter": "early_exit", "exit_layer": 2, "max_draft_tokens": 3, "draft_confidence_threshold": 0.0,
           "draft_tree_top_k": 1}
    base = SelfSpecConfig(metadata={"calibration": {"per_drafter": {"early_exit": old}}})
    space = resolve_space(_spec(exit_layer=[2], draft_confidence_cumulative=[True, False]), 4, [],
                          DRAFTERS)
    study = optuna.create_study(direction="maximize")
    enqueue_previous(study, base, space, log=lambda line: None)
    (queued,) = study.get_trials(deepcopy=False)
    assert queued.system_attrs["fixed_params"] == {**old, "draft_confidence_cumulative": False}


def test_tree_replay_keeps_only_what_the_size_holds():
    """Top-4 children of the root fill a 4-node tree: nothing lies deeper, so even a head always right accepts one
    draft a step (the replay once grew a level beyond the size and predicted 2.4 tokens a step for such trees,
    against 1.9 measured); with room for 2 leaves, a child ranked third is not kept."""
    n, k = 30, 5
    eos = [[False] * n]
    sure = cost_model.LayerAcceptance(2, agree=[[True] * n], conf=[[1.0] * n], rank=[[0] * n], prob=[[1.0] * n])
    full = cost_model.simulate_tree(sure, eos, k, 4, 4, 0.0, max_new_tokens=n)
    assert full.accepted <= full.steps + 1, full  # +1: the last, budget-cut step
    third = cost_model.LayerAcceptance(2, agree=[[False] * n], conf=[[0.3] * n], rank=[[2] * n],
                                       prob=[[0.2] * n])
    widths, nodes = cost_model.tree_shape(2, 3, 5)  # 3 run at depth 1, 2 leaves at depth 2
    assert (widths, nodes) == ([1, 3], 5)
    two = cost_model.simulate_tree(third, eos, 2, 3, 5, 0.0, max_new_tokens=n)
    assert two.accepted <= two.steps + 1, two


def test_loop_overheads_time_chains_whatever_tree_the_base_config_has():
    """The short engine runs that fit the cost model's loop overheads price a drafted token of a chain: with a tree
    in the base config (as a shipped config may have) a tree's nodes would share level passes and make a drafted
    token look cheaper than it is."""
    from selfspec.tools.calibrate.predictor import _engine_seconds, loop_probe_configs

    space = resolve_space(load_search_spec("smollm2-135m"), 4, [2], DRAFTERS)
    base = selfspec.SelfSpecConfig(exit_layer=2, max_draft_tokens=2, draft_tree_top_k=4, draft_tree_size=4)
    configs = loop_probe_configs(base, space)
    assert {name: c.drafter for name, c in configs.items()} == {
        "none_step": "none", "draft_token": "early_exit", "lookup_step": "ngram"}
    assert all(c.draft_tree_top_k == 1 for c in configs.values())
    model = selfspec.wrap(make_model("llama", 4), base)
    try:
        _engine_seconds(model, configs["draft_token"], prompt(seed=10, length=8), 8, repeats=1)
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    assert 0 < stats.drafted_tokens <= 2 * (stats.verify_steps - 1)  # K=2 chains: at most 2 drafts a step


def test_several_heads_directories_refuse_one_study_name(tmp_path):
    from selfspec.tools.calibrate import cli as calibrate_cli

    with pytest.raises(ValueError, match="--study-name names one study, and several --heads run one each"):
        calibrate_cli.main(["--heads", "a", "b", "--study-name", "s"])
    with pytest.raises(ValueError, match="--storage names one study"):
        calibrate_cli.main(["--heads", "a", "b", "--storage", "sqlite:///x.db"])
