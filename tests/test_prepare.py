"""`selfspec prepare` end to end on tiny random models of three families with a JSONL of chats: every stage runs
for real (collect, train, copy, calibrate, report), the result loads and decodes what plain `generate` does, an
interrupted run resumes where it stopped, and bad input is one line."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers as tf

from selfspec.training import prepare
from tiny_tokenizer import tiny_tokenizer

WORDS = ["the", "cat", "sat", "on", "a", "mat", "in", "her", "tree", "river", "code", "fast", "x", "1", "2"]
# tiny sizes: each stage takes seconds
FAST = ["--collect-tokens", "400", "--steps", "12", "--trials", "2", "--calibration-prompts", "2", "--eval-prompts", "1",
        "--max-new-tokens", "12", "--threads", "1", "--dtype", "float32"]


@pytest.fixture(scope="module", autouse=True)
def on_the_host():
    with torch.device("cpu"):
        yield


def sentence(g: torch.Generator, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)).capitalize() + "."


def write_chats(path: Path, count: int = 24) -> Path:
    """Chats whose answers repeat words of their question, so that lookups and heads have something to learn."""
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(count):
            q = sentence(g, 6)
            f.write(json.dumps({"messages": [{"role": "user", "content": q},
                                             {"role": "assistant", "content": q + " " + sentence(g, 5)}]}) + "\n")
    return path


def tiny_model(family: str, vocab: int):
    common = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                                  num_key_value_heads=2, intermediate_size=64, **common))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                                  num_key_value_heads=2, intermediate_size=64, **common))
    # absolute positions: the eval prompts are thousands of tokens of this character-level tokenizer
    return tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=4, n_head=4, n_positions=16384, **common))


def model_dir(root: Path, family: str, chat_template: bool = True) -> Path:
    tok = tiny_tokenizer()
    if not chat_template:
        tok.chat_template = None
    model = tiny_model(family, len(tok))
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    path = root / family
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def greedy_matches_plain(output: Path, path: Path) -> None:
    import selfspec

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([[5, 40, 41, 42, 6, 40, 41]])
    plain = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    selfspec.wrap(model, str(output))
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0), plain)
    assert model.selfspec.last_stats.verify_steps > 0


# llama in the fast subset; the other families run the same stages through their own adapters
@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                    pytest.param("gpt2", marks=pytest.mark.slow)])
def test_prepare_writes_heads_a_config_and_a_report(tmp_path, family, capsys):
    path = model_dir(tmp_path, family)
    out = tmp_path / "out"
    assert prepare.main([str(path), "--output", str(out), "--data", str(write_chats(tmp_path / "chats.jsonl")),
                         *FAST]) == 0
    saved = json.loads((out / "selfspec_config.json").read_text())
    assert sorted(h["exit_layer"] for h in saved["heads"]) == [1, 2]
    assert all(h["copy_max"] > 0 for h in saved["heads"])  # both heads are copy heads
    assert "calibration" in saved["metadata"]  # calibrated on this device
    report = (out / "report.md").read_text()
    for section in ("## Time", "## Agreement", "## Speed", "| hf-prompt-lookup |", "| selfspec-hybrid |"):
        assert section in report, section
    state = json.loads((out / "prepare.json").read_text())
    assert all(state["stages"][s]["done"] for s in prepare.STAGES)
    assert not any(row["differs"] for row in state["stages"]["report"]["bench"].values())
    greedy_matches_plain(out, path)


@pytest.mark.slow  # two trainings and two studies
def test_prepare_with_both_head_kinds_keeps_the_faster(tmp_path):
    """--head both: the MLP heads, a fused head trained from them, each made a copy head (DIR/mlp, DIR/fused),
    calibrated side by side (`calibrate --heads DIR/mlp DIR/fused`, a study each in DIR/heads-N); DIR gets the
    faster one's heads and config, and the report names both results."""
    path = model_dir(tmp_path, "llama")
    out = tmp_path / "out"
    assert prepare.main([str(path), "--output", str(out), "--data", str(write_chats(tmp_path / "chats.jsonl")),
                         "--head", "both", *FAST]) == 0
    state = json.loads((out / "prepare.json").read_text())["stages"]
    assert set(state["train"]["fused"]["agreement"]) == {"1", "2"}
    assert set(state["copy"]["agreement_with_candidate"]) == {"1", "2", "fused-1", "fused-2"}
    kinds = {}
    for kind in ("mlp", "fused"):
        saved = json.loads((out / kind / "selfspec_config.json").read_text())
        kinds[kind] = saved["heads"]
        assert {h["kind"] for h in saved["heads"]} == {kind} and all(h["copy_max"] > 0 for h in saved["heads"])
    compared = json.loads((out / "heads.json").read_text())
    assert [row["kinds"] for row in compared["compared"]] == [["mlp"], ["fused"]]
    speedups = [row["speedup"] for row in compared["compared"]]
    assert compared["fastest"] == speedups.index(max(speedups)) + 1  # each study re-timed against plain generate
    assert state["calibrate"]["fastest"] == compared["fastest"]
    for n in (1, 2):
        assert (out / f"heads-{n}" / "study.db").is_file()
    kept = ("mlp", "fused")[compared["fastest"] - 1]
    assert json.loads((out / "selfspec_config.json").read_text())["heads"] == kinds[kept]
    report = (out / "report.md").read_text()
    assert "| 2, fused |" in report and f"the {kept} heads are kept" in report
    greedy_matches_plain(out, path)


def run_and_stop(argv: list[str], cwd: Path, stop_when, timeout: float = 300) -> tuple[int, str]:
    """`selfspec prepare ARGV` in a process of its own, sent one SIGTERM as soon as `stop_when(output so far)` is
    true (polled every 20 ms; None: never); its exit status and everything it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # unbuffered: each line as printed
    proc = subprocess.Popen([sys.executable, "-m", "selfspec.cli", "prepare", *argv], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    deadline, sent = time.monotonic() + timeout, False
    while proc.poll() is None and time.monotonic() < deadline:
        if not sent and stop_when is not None and stop_when(b"".join(chunks).decode(errors="replace")):
            proc.send_signal(signal.SIGTERM)
            sent = True
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    reader.join(timeout=10)
    text = b"".join(chunks).decode(errors="replace")
    assert stop_when is None or sent, f"the run ended before it could be stopped:\n{text[-3000:]}"
    return proc.wait(), text


@pytest.mark.slow  # six runs of the whole command
def test_a_base_model_resumes_after_a_sigterm_in_every_stage(tmp_path):
    """A base model (no chat template) on ShareGPT-style chats, its teacher-forced and on-policy collection both
    rendered as plain dialogue, stopped by SIGTERM inside each stage in turn: every rerun of the same command keeps
    what the stopped one finished (shards, the training checkpoint, copy heads, measured trials) and the last one
    leaves heads that decode exactly as plain generate does."""
    path = model_dir(tmp_path, "llama", chat_template=False)
    out = tmp_path / "out"
    argv = [str(path), "--output", str(out), "--data", str(write_chats(tmp_path / "chats.jsonl", 1000)),
            "--collect-tokens", "10000000", "--steps", "400", "--trials", "3", "--calibration-prompts", "2",
            "--eval-prompts", "1", "--max-new-tokens", "24", "--threads", "1", "--dtype", "float32"]
    data, heads = out / "data", out / "heads"

    def state():
        return json.loads((out / "prepare.json").read_text())["stages"]

    def stopped_in(stage):
        code, text = run_and_stop(argv, tmp_path, stops[stage])
        assert code == 130 and "selfspec prepare: interrupted" in text, text[-3000:]
        assert not state()[stage].get("done") and state()[stage]["seconds"] > 0
        return text

    stops = {"collect": lambda text: "tf-00001:" in text,
             "train": lambda text: (heads / "checkpoint.safetensors").is_file(),
             "copy": lambda text: "1" in state().get("copy", {}).get("agreement_with_candidate", {}),
             # a trial's line is printed as it ends: after the second, the first is stored
             "calibrate": lambda text: len(re.findall(r"trial +\d+ .*tok/s", text)) >= 2,
             "report": lambda text: "bench:" in text}
    stopped_in("collect")
    first = {p.name: p.stat().st_mtime_ns for p in data.glob("tf-*.safetensors")}
    assert first
    text = stopped_in("train")
    assert "has no chat template: chats are rendered as plain dialogue" in text and list(data.glob("op-*"))
    assert all(data.joinpath(n).stat().st_mtime_ns == t for n, t in first.items())  # stored shards are kept
    text = stopped_in("copy")
    assert "resumed at step 100 of 400" in text
    copied = (out / "copy-1" / "train_copy.json").stat().st_mtime_ns
    stopped_in("calibrate")
    trials = len(optuna_trials(out))
    assert trials >= 1 and (out / "copy-1" / "train_copy.json").stat().st_mtime_ns == copied
    stopped_in("report")
    assert len(optuna_trials(out)) >= trials + 3  # the stopped run's trials stay in the study
    code, text = run_and_stop(argv, tmp_path, None)
    assert code == 0, text[-3000:]
    assert all(state()[s]["done"] for s in prepare.STAGES)
    greedy_matches_plain(out, path)


def optuna_trials(out: Path) -> list:
    import optuna

    storage = f"sqlite:///{out / 'study.db'}"
    (name,) = optuna.get_all_study_names(storage)
    return [t for t in optuna.load_study(study_name=name, storage=storage).trials
            if t.state == optuna.trial.TrialState.COMPLETE]


def test_a_base_model_without_a_chat_template_trains_on_plain_text(tmp_path):
    path = model_dir(tmp_path, "llama", chat_template=False)
    data = tmp_path / "texts.jsonl"
    g = torch.Generator().manual_seed(1)
    data.write_text("".join(json.dumps({"text": " ".join(sentence(g, 8) for _ in range(4))}) + "\n"
                            for _ in range(20)))
    out = tmp_path / "out"
    assert prepare.main([str(path), "--output", str(out), "--data", str(data), *FAST]) == 0
    assert json.loads((out / "prepare.json").read_text())["stages"]["report"]["bench"]


def test_prompts_without_answers_are_answered_and_trained_on(tmp_path):
    """--data of prompts alone (a deployment's own questions, no answers): the collection is the model's own answer
    to every one of them, and the heads train on those."""
    path = model_dir(tmp_path, "llama")
    data = tmp_path / "prompts.jsonl"
    g = torch.Generator().manual_seed(2)
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": sentence(g, 6)}]}) + "\n"
                            for _ in range(16)))
    out = tmp_path / "out"
    assert prepare.main([str(path), "--output", str(out), "--data", str(data), *FAST]) == 0
    totals = json.loads((out / "data" / "manifest.json").read_text())["totals"]
    assert totals["teacher_forced"]["n_seqs"] == 0 and totals["onpolicy"]["n_seqs"] == 16
    assert (out / "heads.safetensors").is_file()


def test_help_shows_every_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        prepare.parse_args(["--help"])
    assert stop.value.code == 0 and "collect 45%, train 25%" in capsys.readouterr().out


def test_budget_split_and_exit_layers():
    assert prepare.parse_budget("2h") == 7200 and prepare.parse_budget("1h30m") == 5400
    assert prepare.parse_budget("90") == 90
    plan = prepare.plan_budget(3600)
    assert sum(plan.values()) == pytest.approx(3600) and plan["collect"] > plan["train"] > plan["calibrate"]
    assert prepare.parse_stage_budgets("collect=10m, train=1h") == {"collect": 600, "train": 3600}
    with pytest.raises(ValueError, match=r"--budget 'trian=1h' names no stage; write stage=duration"):
        prepare.parse_stage_budgets("collect=10m,trian=1h")
    assert prepare.pick_exit_layers(30) == [1, 2, 3] and prepare.pick_exit_layers(4) == [1, 2]
    assert prepare.pick_exit_layers(28) == [1, 2, 3]


def test_the_head_kind_by_default_follows_the_device():
    """--head auto (the default): the MLP heads alone on a CPU, both kinds calibrated side by side on a GPU."""
    assert prepare.parse_args(["m", "--output", "o"]).head == "mlp"
    assert prepare.parse_args(["m", "--output", "o", "--device", "cuda:1"]).head == "both"
    assert prepare.parse_args(["m", "--output", "o", "--device", "cuda", "--head", "mlp"]).head == "mlp"


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "selfspec.cli", "prepare", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


@pytest.mark.parametrize("case", ["budget", "duration", "data", "family", "other-model"])
def test_bad_input_is_one_line_with_the_fix(tmp_path, case):
    path = model_dir(tmp_path, "llama")
    chats = write_chats(tmp_path / "chats.jsonl")
    args, expect = {
        "budget": ([str(path), "--output", "o", "--budget", "30s"], "too small to train anything"),
        "duration": ([str(path), "--output", "o", "--budget", "two hours"], "write it like 2h"),
        "data": ([str(path), "--output", "o", "--data", "nope.jsonl"], "--data 'nope.jsonl' does not exist"),
        "family": ([str(tmp_path / "opt"), "--output", "o"], "which selfspec does not support"),
        "other-model": ([str(path), "--output", "held", "--data", str(chats)], "holds selfspec heads"),
    }[case]
    if case == "family":
        tf.OPTForCausalLM(tf.OPTConfig(vocab_size=120, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                       num_attention_heads=2, word_embed_proj_dim=16)).save_pretrained(tmp_path / "opt")
        tiny_tokenizer().save_pretrained(tmp_path / "opt")
    if case == "other-model":
        (tmp_path / "held").mkdir()
        (tmp_path / "held" / "selfspec_config.json").write_text(json.dumps({"base_model": {"num_layers": 30}}))
    done = _cli(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and expect in done.stderr, done.stderr


def test_data_collected_before_with_more_layers_is_reused(tmp_path):
    """Shards collected beforehand into DIR/data, storing more layers than the heads need, are kept as they are:
    collection goes on with their layers instead of refusing them as other settings."""
    from selfspec.training import collect

    path = model_dir(tmp_path, "llama")
    out, chats = tmp_path / "out", write_chats(tmp_path / "chats.jsonl")
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{name_or_path: {path}}}\ncollect: {{sharegpt: {{store_dtype: bfloat16}}}}\n")
    assert collect.main(["--source", "sharegpt", "--config", str(config), "--cache-dir", str(out / "data"),
                         "--data", str(chats), "--exit-layers", "1,2,3", "--dtype", "float32", "--threads", "1"]) == 0
    before = {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.safetensors")}
    assert prepare.main([str(path), "--output", str(out), "--data", str(chats), "--exit-layers", "1,2", *FAST]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (out / "data").glob("*.safetensors")} == before
