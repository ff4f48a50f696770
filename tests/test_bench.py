"""`selfspec bench` on small random models: every method runs and matches hf-greedy, a planted mismatch is caught,
the oracle drafter accepts everything (and only because its proposals are right), outputs and CLI work."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import transformers as tf

import selfspec
from conftest import make_model, padded_batch, prompt
from selfspec.drafters.oracle import OracleDrafter
from selfspec.signals import sigterm_as_interrupt
from selfspec.tools import bench, bench_methods, bench_report, measure, report

EOS = 2
SMALL = dict(model="tiny-llama", exit_layer=2, max_draft_tokens=4, max_new_tokens=12, warmup_tokens=4, tune_tokens=4)


def _batch(category: str, seed: int, length: int = 8) -> bench.Batch:
    ids = prompt(seed=seed, length=length)
    return bench.Batch(category, [f"{category}-{seed}"], ids, torch.ones_like(ids))


def _workload(per_category: int = 2) -> bench.Workload:
    measured = [_batch(c, 10 * i + j) for i, c in enumerate(("qa", "rag")) for j in range(per_category)]
    return bench.Workload(measured, warmup=_batch("warmup", 90), tune=[_batch("tune", 91)])


def _run(model, registry=None, workload=None, **cfg):
    config = bench.BenchConfig(**{**SMALL, **cfg})
    return bench.run_bench(model, workload or _workload(), config, pad_id=0, eos_ids=[EOS], registry=registry)


def _meta(cfg: bench.BenchConfig) -> dict:
    machine = {**measure.machine_info(torch.device("cpu")), "loadavg_start": None, "loadavg_end": None}
    return {"command": "test", "machine": machine, "versions": measure.versions(),
            "model": {"name": "tiny-llama", "dtype": "float64"}, "settings": bench.asdict(cfg)}


@pytest.fixture(scope="module")
def model():
    return make_model("llama", 4)


@pytest.fixture(scope="module")
def result(model):
    return _run(model)


def test_every_method_runs_on_every_prompt_and_matches_hf_greedy(result):
    expected = list(bench_methods.default_methods())
    assert result.names == expected and "oracle" in expected and "hf-early-exit" in expected
    for name in expected:
        mine = [r for r in result.records if r.method == name]
        assert [r.question_ids for r in mine] == [["qa-0"], ["qa-1"], ["rag-10"], ["rag-11"]], name
        assert all(r.exact and r.new_tokens > 0 and r.seconds > 0 for r in mine), name
    assert not result.mismatches
    overall = result.summary["overall"]
    assert set(result.summary) == {"qa", "rag", "overall"}
    assert overall["hf-greedy"]["speedup"] == pytest.approx(1.0)
    assert overall["oracle"]["oracle_fraction"] == pytest.approx(1.0)
    assert all(row["exact"] == 4 and row["prompts"] == 4 for row in overall.values())
    assert result.setup["hf_early_exit_layer"] in (1, 2, 3)  # chosen among L/4, L/2, 3L/4, E


def test_acceptance_columns_mean_what_they_say(result):
    overall = result.summary["overall"]
    # the oracle proposes the true continuation: everything it drafts is accepted, K + 1 tokens per pass at most
    assert overall["oracle"]["acceptance"] == 1.0
    assert 2.0 < overall["oracle"]["mean_accepted"] <= SMALL["max_draft_tokens"] + 1
    # no drafting: one token per full pass; the plain model likewise
    assert overall["selfspec-ar"]["mean_accepted"] == 1.0 and overall["selfspec-ar"]["acceptance"] is None
    assert overall["hf-greedy"]["mean_accepted"] == 1.0
    assert 0.0 < overall["selfspec-untrained"]["acceptance"] < 1.0
    assert overall["hf-early-exit"]["mean_accepted"] > 1.0  # HF's candidates are counted too


class PacedEarlyExit(bench_methods.HFMethod):
    """hf-early-exit run for real, its time replaced by a planted pace per exit layer; logs (E, prompt) it ran."""

    def __init__(self, pace: dict[int, float]):
        base = bench_methods.METHODS["hf-early-exit"]
        super().__init__("hf-early-exit, paced", base.extra, base.chunk)
        self.pace, self.ran = pace, []

    def run(self, h, batch, reference, max_new):
        out = super().run(h, batch, reference, max_new)
        self.ran.append((h.hf_exit_layer, batch.question_ids[0]))
        out.seconds = sum(map(len, out.rows)) / self.pace[h.hf_exit_layer]
        return out


def test_a_deep_exit_far_behind_on_the_first_prompt_is_not_timed_again(model):
    """hf-early-exit's E: every candidate runs the first tuning prompt, those within 0.8 of its fastest run the
    rest, and the fastest of those over all of them is used."""
    method = PacedEarlyExit({1: 10.0, 2: 9.0, 3: 2.0})
    h = bench.Harness(model, bench.BenchConfig(**SMALL), 0, [EOS])
    tune = [_batch("tune", 91), _batch("tune", 92)]
    speeds = bench.tune_hf_exit(h, {"hf-early-exit": method}, tune, [1, 2, 3])
    assert method.ran == [(1, "tune-91"), (2, "tune-91"), (3, "tune-91"), (1, "tune-92"), (2, "tune-92")]
    assert speeds == pytest.approx({1: 10.0, 2: 9.0, 3: 2.0}) and h.hf_exit_layer == 1


class Perturbed(bench_methods.HFMethod):
    """hf-greedy with one token changed: a planted mismatch."""

    def run(self, h, batch, reference, max_new):
        out = super().run(h, batch, reference, max_new)
        out.rows[0][-1] = (out.rows[0][-1] + 1) % 96
        return out


def test_planted_mismatch_is_reported_loudly(model, capsys, tmp_path):
    registry = {**bench_methods.METHODS, "perturbed": Perturbed("hf-greedy with its last token changed")}
    res = _run(model, registry, methods=("hf-greedy", "perturbed", "selfspec-untrained"))
    bad = [r for r in res.records if r.method == "perturbed"]
    assert bad and all(r.exact is False and r.mismatches and r.outputs for r in bad)
    assert {m["method"] for m in res.mismatches} == {"perturbed"}
    assert res.summary["overall"]["perturbed"]["exact"] == 0
    assert res.summary["overall"]["selfspec-untrained"]["exact"] == 4  # the negative control stays clean
    # a changed token where the model was sure is a bug, whatever the dtype: verdict "differs", never near-tie
    assert all(m["verdict"] == "differs" and m["gap"] > 2 * m["discrepancy"] for m in res.mismatches)
    assert res.summary["overall"]["perturbed"]["differs"] == 4
    assert "!! DIFFERS: perturbed parts from hf-greedy" in capsys.readouterr().err
    cfg = bench.BenchConfig(**SMALL)
    paths = bench_report.write_outputs(res, _meta(cfg), tmp_path)
    text = paths["md"].read_text()
    assert "4 DIFFER(S)" in text and "**0 / 0 / 4 DIFFERS**" in text
    assert json.loads(paths["json"].read_text())["mismatches"][0]["method"] == "perturbed"


class PerturbedTree(bench_methods.EngineMethod):
    """selfspec-tree with one token changed, so that its output is judged."""

    def run(self, h, batch, reference, max_new):
        out = super().run(h, batch, reference, max_new)
        out.rows[0][-1] = (out.rows[0][-1] + 1) % 96
        return out


def test_each_method_is_judged_against_its_own_verify_pass(model, monkeypatch):
    """A near-tie is judged against the rounding of the pass shape that produced it: a tree's node count plus one,
    prompt lookup's N + 1, a chain's K + 1."""
    chunks = []

    def spy(*args, chunk, **kwargs):
        chunks.append(chunk)
        return judge(*args, chunk=chunk, **kwargs)

    judge = bench.judge
    monkeypatch.setattr(bench, "judge", spy)
    registry = {**bench_methods.METHODS, "perturbed": Perturbed("hf-greedy, changed"),
                "perturbed-tree": PerturbedTree("selfspec-tree, changed", "early_exit", tree=True)}
    _run(model, registry, methods=("hf-greedy", "perturbed-tree"))
    assert chunks and set(chunks) == {bench_methods.DEFAULT_TREE["draft_tree_size"] + 1}, chunks
    chunks.clear()
    _run(model, registry, methods=("hf-greedy", "perturbed"))
    assert set(chunks) == {SMALL["max_draft_tokens"] + 1}, chunks
    h = bench.Harness(model, bench.BenchConfig(**SMALL), pad_id=0, eos_ids=[EOS])
    assert bench_methods.METHODS["hf-prompt-lookup"].verify_chunk(h) == h.cfg.prompt_lookup_tokens + 1


class Terminating(bench_methods.HFMethod):
    """hf-greedy that sends its own process SIGTERM (what `timeout` sends) when it reaches the prompt `at`."""

    def __init__(self, at: str):
        super().__init__("hf-greedy, then SIGTERM")
        self.at = at

    def run(self, h, batch, reference, max_new):
        if batch.question_ids[0] == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().run(h, batch, reference, max_new)


def test_a_run_stopped_by_sigterm_reports_the_prompts_every_method_finished(model, tmp_path):
    registry = {**bench_methods.METHODS, "stopper": Terminating(at="rag-10")}
    with sigterm_as_interrupt():
        res = _run(model, registry, methods=("hf-greedy", "selfspec-untrained", "stopper"))
    assert res.stopped == "stopped by an interrupt after 2 of 4 batches"
    # the third batch's finished runs are dropped with it: each method counts on the same prompts
    assert sorted((r.method, r.question_ids[0]) for r in res.records) == sorted(
        (m, q) for m in ("hf-greedy", "selfspec-untrained", "stopper") for q in ("qa-0", "qa-1"))
    assert set(res.summary) == {"qa", "overall"} and res.summary["overall"]["hf-greedy"]["prompts"] == 2
    paths = bench_report.write_outputs(res, _meta(bench.BenchConfig(**SMALL)), tmp_path)
    assert "**stopped by an interrupt after 2 of 4 batches**" in paths["md"].read_text()
    assert json.loads(paths["json"].read_text())["stopped"] == res.stopped
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back
    # stopped before any batch is done: nothing to report, the interrupt goes on
    with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
        _run(model, {**bench_methods.METHODS, "stopper": Terminating(at="qa-0")}, methods=("hf-greedy", "stopper"))


def test_outputs_written(result, tmp_path):
    cfg = bench.BenchConfig(**SMALL)
    paths = bench_report.write_outputs(result, _meta(cfg), tmp_path / "out")
    data = json.loads(paths["json"].read_text())
    assert {"meta", "setup", "summary", "records", "mismatches"} <= set(data)
    assert data["meta"]["machine"]["cores"] >= 1 and data["meta"]["versions"]["torch"] == torch.__version__
    assert len(data["records"]) == 4 * len(result.names)
    assert data["records"][0]["outputs"]  # the baseline's tokens are kept
    md = paths["md"].read_text()
    assert "## overall (4 prompts)" in md and "## qa (2 prompts)" in md and "| oracle |" in md
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batched_run_skips_hf_assisted_and_stays_exact(model):
    ids, mask = padded_batch(seed=3)
    work = bench.Workload([bench.Batch("qa", ["a", "b", "c"], ids, mask)], _batch("w", 1), [])
    res = _run(model, workload=work, batch_size=3)
    assert set(res.setup["skipped_methods"]) == {"hf-early-exit", "hf-prompt-lookup"}
    assert not res.mismatches and all(r.exact for r in res.records)
    assert res.summary["overall"]["oracle"]["acceptance"] == 1.0


def test_oracle_drafter_exact_and_acceptance_depends_on_its_proposals(model):
    ids, mask = padded_batch(seed=4)
    gen = dict(max_new_tokens=14, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, attention_mask=mask, **gen)
    rows = [bench.trim_at_eos(r, {EOS}) for r in ref[:, ids.shape[1]:].tolist()]
    wrong = [[(t + 1) % 96 for t in r] for r in rows]  # negative control: every proposal false
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=5)
    try:
        for targets, rate in ((rows, 1.0), (wrong, 0.0)):
            model.selfspec.drafter_override = OracleDrafter.from_rows(targets)
            assert torch.equal(model.generate(ids, attention_mask=mask, **gen), ref)
            assert model.selfspec.last_stats.acceptance_rate == rate
    finally:
        selfspec.unwrap(model)


def test_oracle_needs_a_reference(model):
    selfspec.wrap(model, drafter="oracle", exit_layer=2)
    try:
        with pytest.raises(ValueError, match="drafter_override"):
            model.generate(prompt(seed=1), max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        selfspec.unwrap(model)


def test_heads_dir_feeds_the_selfspec_method(model, tmp_path):
    from selfspec.heads import MLPHead

    torch.manual_seed(0)
    head = MLPHead(3, 32)
    torch.nn.init.normal_(head.down.weight, std=1.0)  # far from the plain exit, so its drafts differ
    selfspec.wrap(model, exit_layer=3, max_draft_tokens=3)
    model.selfspec.add_head(head)
    model.selfspec.save_pretrained(str(tmp_path / "heads"))
    selfspec.unwrap(model)
    res = _run(model, methods=("hf-greedy", "selfspec-untrained", "selfspec", "selfspec-tree"),
               heads=str(tmp_path / "heads"), exit_layer=None, max_draft_tokens=None)
    assert res.setup["heads"] == [3] and res.setup["selfspec_config"]["exit_layer"] == 3
    assert not res.mismatches  # a bad head costs speed, never tokens
    drafted = {n: [(r.drafted, r.accepted) for r in res.records if r.method == n] for n in res.names}
    assert drafted["selfspec"] != drafted["selfspec-untrained"]
    # the same head drafting trees (bench_methods.DEFAULT_TREE, no calibrated tree here): more drafts per pass
    assert sum(d for d, _ in drafted["selfspec-tree"]) > 2 * sum(d for d, _ in drafted["selfspec"])
    assert "trees of top-4, 16 nodes" in res.setup["engine_settings"]["selfspec-tree"]


def test_chain_methods_draft_chains_when_the_calibrated_winner_is_a_tree(model, tmp_path):
    """A calibration won by a tree saves a config that grows trees; the hybrid's and the chain's per_drafter entries
    said nothing of trees (older studies did not record draft_tree_top_k), and the hybrid then inherited the
    winner's tree. Methods other than selfspec-tree draft chains, as they were measured."""
    from selfspec.heads import MLPHead

    per = {"hybrid": {"drafter": "hybrid", "exit_layer": 3, "max_draft_tokens": 3, "hybrid_min_match": 2},
           "early_exit": {"drafter": "early_exit", "exit_layer": 3, "max_draft_tokens": 2}}
    selfspec.wrap(model, exit_layer=3, max_draft_tokens=3, draft_tree_top_k=3, draft_tree_size=6,
                  metadata={"calibration": {"per_drafter": per}})
    model.selfspec.add_head(MLPHead(3, 32))
    model.selfspec.save_pretrained(str(tmp_path / "heads"))
    selfspec.unwrap(model)
    res = _run(model, methods=("hf-greedy", "selfspec", "selfspec-hybrid", "selfspec-tree", "selfspec-hybrid-tree"),
               heads=str(tmp_path / "heads"), exit_layer=None, max_draft_tokens=None)
    settings = res.setup["engine_settings"]
    assert "trees" not in settings["selfspec"] and "trees" not in settings["selfspec-hybrid"], settings
    assert "min match 2" in settings["selfspec-hybrid"] and "trees of" in settings["selfspec-tree"]
    # the hybrid's trees: its chain's calibrated setting with the default tree (no "hybrid-tree" entry)
    assert "min match 2" in settings["selfspec-hybrid-tree"] and "trees of top-4" in settings["selfspec-hybrid-tree"]
    assert not res.mismatches


def test_no_heads_method_runs_what_wrap_runs_without_heads(model, tmp_path):
    """selfspec-no-heads measures the first thing a user meets, `selfspec.wrap(model)`: neither the calibrated
    n-gram setting of --heads nor the command line's K reaches it."""
    per = {"ngram": {"drafter": "ngram", "max_draft_tokens": 2, "ngram_max": 2}}
    selfspec.wrap(model, exit_layer=3, max_draft_tokens=3, metadata={"calibration": {"per_drafter": per}})
    model.selfspec.save_pretrained(str(tmp_path / "heads"))
    selfspec.unwrap(model)
    res = _run(model, methods=("hf-greedy", "selfspec-ngram", "selfspec-no-heads"), heads=str(tmp_path / "heads"))
    with pytest.warns(UserWarning, match="no trained exit heads"):
        selfspec.wrap(model)
    try:
        default = bench_methods.engine_settings(model.selfspec.config)
    finally:
        selfspec.unwrap(model)
    settings = res.setup["engine_settings"]
    assert settings["selfspec-no-heads"] == default != settings["selfspec-ngram"], settings
    assert not res.mismatches


def test_sampling_mode_reports_speed_not_exactness(model):
    res = _run(model, methods=("hf-greedy", "selfspec-untrained", "oracle"), sample=True, temperature=0.8,
               top_p=0.9)
    assert all(r.exact is None for r in res.records)
    assert res.summary["overall"]["selfspec-untrained"]["exact"] is None
    assert "n/a" in report.markdown_table(res.summary["overall"])


def test_bad_input_gets_clear_errors(model):
    with pytest.raises(ValueError, match="Unknown method.*available"):
        _run(model, methods=("hf-greedy", "selfspec-magic"))
    with pytest.raises(ValueError, match="training/calibration split"):
        bench.check_categories(bench.BenchConfig(categories=("qa", "writing")))
    with pytest.raises(ValueError, match="exit_layer=9 is out of range"):
        _run(model, exit_layer=9)
    assert bench.main(["--limit", "0"]) == 2
    assert bench.main(["--sample", "--top-p", "1.5"]) == 2


def test_sampling_words_name_top_p():
    assert bench_report._sampling_words({"temperature": 0.7, "top_p": 0.9}) == "sampling, temperature 0.7, top-p 0.9"
    assert bench_report._sampling_words({"temperature": 1.0}) == "sampling, temperature 1.0"  # older results


def test_help_works(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--max-new-tokens" in text and "--methods" in text and "hf-prompt-lookup" in text
    from selfspec.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "--help"])
    assert exit_info.value.code == 0 and "usage: selfspec bench" in capsys.readouterr().out


def _byte_tokenizer():
    """A byte-level tokenizer with a chat template, built offline (260 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                      eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return fast


def test_cli_end_to_end_on_a_saved_model(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=260, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=1024,
                         pad_token_id=0, bos_token_id=1, eos_token_id=EOS)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    _byte_tokenizer().save_pretrained(tmp_path / "model")
    questions = [{"question_id": i, "category": c, "turns": [f"Question {i}: say something about {c}.", "again"]}
                 for i, c in enumerate(["alpha", "alpha", "beta"])]
    (tmp_path / "q.jsonl").write_text("\n".join(json.dumps(q) for q in questions) + "\n")
    out = tmp_path / "results"
    code = bench.main(["--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "q.jsonl"),
                       "--limit", "1", "--max-new-tokens", "8", "--exit-layer", "2", "--max-draft-tokens", "3",
                       "--dtype", "float32", "--methods", "hf-greedy,selfspec-untrained", "oracle",
                       "--output", str(out), "--warmup-tokens", "2"])
    assert code == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["settings"]["max_new_tokens"] == 8
    assert [r["question_ids"] for r in data["records"] if r["method"] == "oracle"] == [[0], [2]]
    assert all(r["exact"] for r in data["records"])
    assert (out / "speedup.png").is_file() and "## alpha (1 prompts)" in (out / "results.md").read_text()
    assert "| selfspec-untrained |" in capsys.readouterr().out
    both = tmp_path / "both"
    code = bench.main(["--model", str(tmp_path / "model"), "--prompts", str(tmp_path / "q.jsonl"),
                       "--limit", "1", "--max-new-tokens", "6", "--exit-layer", "2", "--dtype", "float32",
                       "--methods", "hf-greedy", "selfspec-untrained", "--output", str(both), "--warmup-tokens", "2",
                       "--greedy-and-sampled", "--temperature", "0.7"])
    greedy, sampled = (json.loads((both / mode / "results.json").read_text()) for mode in ("greedy", "sampled"))
    assert code == 0 and not greedy["meta"]["settings"]["sample"] and sampled["meta"]["settings"]["sample"]
    assert sampled["meta"]["settings"]["temperature"] == 0.7 and all(r["exact"] is None for r in sampled["records"])
    assert bench.main(["--sample", "--greedy-and-sampled"]) == 2


def test_compiled_methods_are_warmed_up_and_compile_nothing_after():
    """With --compile every selfspec method compiles its pass shapes before the first prompt (SelfSpecEngine.warmup),
    so the prompts of every length after it compile nothing: Dynamo's frame counter and the compiled step's shapes
    stand still, and the report says so."""
    model = make_model("llama", 4, dtype=torch.float32)
    work = bench.Workload([_batch(c, s, length=5 + 3 * s) for c in ("qa", "rag") for s in (1, 2)],
                          warmup=_batch("warmup", 90), tune=[])
    res = _run(model, workload=work, methods=("hf-greedy", "selfspec-hybrid"), compile=True)
    assert set(res.setup["warm_up_seconds"]) == {"selfspec-hybrid"}
    assert res.setup["compiled_after_warm_up"] == {"dynamo_frames": 0, "selfspec_shapes": 0}
    assert all(row["exact"] == row["prompts"] for row in res.summary["overall"].values())
