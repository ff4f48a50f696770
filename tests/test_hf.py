"""A wrapped model behaves like the unwrapped one for everything generate() and pipeline() take.

Uses a tiny random Llama over a small byte-level BPE tokenizer built in the test (tiny_tokenizer.py: a real fast
tokenizer with merges, special tokens and a chat template), so tokenizer-facing features (stop strings, streamers,
pipelines) are tested for real at small-model speed and never skip for want of a downloaded tokenizer."""
from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch
import transformers as tf
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, TextIteratorStreamer, TextStreamer)

import selfspec
from conftest import make_model
from tiny_tokenizer import tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(4)  # a seed whose greedy text does not fall into a short loop at once (stop tests need variety)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    m = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                mod.weight.mul_(0.3)
        m.lm_head.weight.mul_(30.0)  # peaky logits, like a trained model's
    return m.double().eval()


def both(model, fn, **cfg):
    """fn(model) on the plain model, then wrapped; returns (plain, wrapped) results."""
    plain = fn(model)
    selfspec.wrap(model, **{"exit_layer": 2, "max_draft_tokens": 4, **cfg})
    try:
        return plain, fn(model)
    finally:
        selfspec.unwrap(model)


def ids_of(tok, text="The quick brown fox jumps over the lazy dog. The quick brown"):
    return tok(text, return_tensors="pt")


# --- generate kwargs ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=30),
    dict(max_length=80),  # the prompt is 54 tokens
    dict(max_new_tokens=30, min_new_tokens=25),
    dict(max_new_tokens=30, repetition_penalty=1.3),
    dict(max_new_tokens=30, no_repeat_ngram_size=2),
])
def test_greedy_kwargs(model, tok, kwargs):
    enc = ids_of(tok)
    plain, wrapped = both(model, lambda m: m.generate(**enc, do_sample=False, **kwargs))
    assert torch.equal(plain, wrapped)


def test_eos_list_and_pad(model, tok):
    enc = ids_of(tok)
    free = model.generate(**enc, max_new_tokens=30, do_sample=False)[0, enc["input_ids"].shape[1]:]
    eos = [int(free[12]), int(free[20]), 7]
    kw = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=5)
    plain, wrapped = both(model, lambda m: m.generate(**enc, **kw))
    assert torch.equal(plain, wrapped) and plain.shape[1] < enc["input_ids"].shape[1] + 30


def test_generation_config_of_model_honoured(model, tok):
    enc = ids_of(tok)
    saved = model.generation_config
    model.generation_config = GenerationConfig(max_new_tokens=17, do_sample=False, repetition_penalty=1.2,
                                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        plain, wrapped = both(model, lambda m: m.generate(**enc))
        explicit = both(model, lambda m: m.generate(**enc, generation_config=GenerationConfig(
            max_new_tokens=9, do_sample=False)))
    finally:
        model.generation_config = saved
    assert torch.equal(plain, wrapped) and plain.shape[1] == enc["input_ids"].shape[1] + 17
    assert torch.equal(*explicit) and explicit[0].shape[1] == enc["input_ids"].shape[1] + 9


class BanToken(LogitsProcessor):
    selfspec_pure = True  # a function of its arguments only: it may run inside speculation

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        scores[:, self.token] = -float("inf")
        return scores


class StopAfter(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_processor_and_criteria(model, tok):
    enc = ids_of(tok)
    free = model.generate(**enc, max_new_tokens=30, do_sample=False)[0, enc["input_ids"].shape[1]:]
    kw = dict(max_new_tokens=30, do_sample=False, logits_processor=LogitsProcessorList([BanToken(int(free[3]))]))
    plain, wrapped = both(model, lambda m: (m.generate(**enc, **kw), getattr(m, "selfspec", None)))
    assert wrapped[1].last_stats is not None  # ran speculatively, not through the plain-generate fallback
    assert torch.equal(plain[0], wrapped[0])
    stop = int(free[10])  # a token the unconstrained greedy run produces
    kw = dict(max_new_tokens=30, do_sample=False, stopping_criteria=StoppingCriteriaList([StopAfter(stop)]))
    plain, wrapped = both(model, lambda m: m.generate(**enc, **kw))
    assert torch.equal(plain, wrapped) and plain.shape[1] < enc["input_ids"].shape[1] + 30


def test_stop_strings(model, tok):
    enc = ids_of(tok)
    text = tok.decode(model.generate(**enc, max_new_tokens=30, do_sample=False)[0, enc["input_ids"].shape[1]:])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    kw = dict(max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tok)
    plain, wrapped = both(model, lambda m: m.generate(**enc, **kw))
    assert torch.equal(plain, wrapped)
    # HF also stops on a stop string that begins in the prompt or ends inside the last token
    assert stop in tok.decode(wrapped[0]) and wrapped.shape[1] < enc["input_ids"].shape[1] + 30
    selfspec.wrap(model, exit_layer=2)
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(**enc, max_new_tokens=5, stop_strings=["x"])
    selfspec.unwrap(model)


def test_scores_match(model, tok):
    enc = ids_of(tok)
    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
              repetition_penalty=1.1)
    plain, wrapped = both(model, lambda m: m.generate(**enc, **kw))
    assert torch.equal(plain.sequences, wrapped.sequences)
    assert len(plain.scores) == len(wrapped.scores) == 20
    for a, b in zip(plain.scores, wrapped.scores):
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b))
        assert torch.allclose(a[finite].float(), b[finite].float(), atol=1e-4)


def test_text_streamer(model, tok, capsys):
    enc = ids_of(tok)
    plain, wrapped = both(model, lambda m: m.generate(**enc, max_new_tokens=20, do_sample=False,
                                                      streamer=TextStreamer(tok, skip_prompt=True)))
    printed = capsys.readouterr().out
    expected = tok.decode(plain[0, enc["input_ids"].shape[1]:])
    assert printed == expected + "\n" + expected + "\n"


def test_iterator_streamer_sees_the_end(model, tok):
    enc = ids_of(tok)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    try:
        streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=60)
        result = {}
        worker = threading.Thread(target=lambda: result.setdefault(
            "out", model.generate(**enc, max_new_tokens=25, do_sample=False, streamer=streamer)))
        worker.start()
        text = "".join(streamer)  # ends only when the streamer is told the stream ended
        worker.join(60)
    finally:
        selfspec.unwrap(model)
    assert text == tok.decode(result["out"][0, enc["input_ids"].shape[1]:])


@pytest.mark.parametrize("kwargs,why", [
    (dict(num_beams=2), "beam search"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(use_cache=False), "use_cache=False"),
])
def test_fallbacks_warn_once_and_match(model, tok, kwargs, why):
    import selfspec.hf

    selfspec.hf._warned.clear()
    enc = ids_of(tok)
    plain = model.generate(**enc, max_new_tokens=8, do_sample=False, **kwargs)
    selfspec.wrap(model, exit_layer=2)
    try:
        with pytest.warns(UserWarning, match=why):
            wrapped = model.generate(**enc, max_new_tokens=8, do_sample=False, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second time it stays quiet
            model.generate(**enc, max_new_tokens=8, do_sample=False, **kwargs)
    finally:
        selfspec.unwrap(model)
    seq = lambda o: o if isinstance(o, torch.Tensor) else o.sequences
    assert torch.equal(seq(plain), seq(wrapped))


# --- batches ----------------------------------------------------------------------------------------------------

TEXTS = ["The quick brown fox jumps over", "Once upon a time", "1, 2, 3, 4, 5,"]


def batch_of(tok):
    return tok(TEXTS, return_tensors="pt", padding=True)  # left-padded: rows of different lengths


def test_stop_strings_batch(model, tok):
    enc = batch_of(tok)
    width = enc["input_ids"].shape[1]
    free = model.generate(**enc, max_new_tokens=30, do_sample=False)
    texts = [tok.decode(row[width:]) for row in free]
    stops = [texts[0][8:11], texts[2][20:23]]  # rows 0 and 2 stop at different points, row 1 maybe never
    kw = dict(max_new_tokens=30, do_sample=False, stop_strings=stops, tokenizer=tok)
    plain, wrapped = both(model, lambda m: m.generate(**enc, **kw))
    assert torch.equal(plain, wrapped)
    assert plain.shape[1] < free.shape[1] or not torch.equal(plain, free[:, : plain.shape[1]])  # stops took effect
    assert stops[0] in tok.decode(plain[0]) and stops[1] in tok.decode(plain[2])


def test_scores_batch(model, tok):
    """Rows that end at different steps: scores equal HF's for every step up to and including a row's EOS; after it
    HF scores the padding it appends, selfspec gives -inf (it runs no pass for a finished row)."""
    enc = batch_of(tok)
    width = enc["input_ids"].shape[1]
    free = model.generate(**enc, max_new_tokens=20, do_sample=False)
    eos = [int(free[0, width + 4]), int(free[1, width + 11])]
    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
              repetition_penalty=1.1, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    plain, wrapped = both(model, lambda m: m.generate(**enc, **kw))
    assert torch.equal(plain.sequences, wrapped.sequences)
    steps = len(plain.scores)
    assert len(wrapped.scores) == steps == plain.sequences.shape[1] - width
    ends = []
    for b in range(len(TEXTS)):
        is_eos = torch.isin(plain.sequences[b, width:], torch.tensor(eos))
        ends.append(int(is_eos.long().argmax()) + 1 if bool(is_eos.any()) else steps)
        for t in range(steps):
            a, w = plain.scores[t][b], wrapped.scores[t][b]
            assert w.shape == a.shape
            if t < ends[b]:
                finite = torch.isfinite(a)
                assert torch.equal(finite, torch.isfinite(w)), (b, t)
                assert torch.allclose(a[finite].float(), w[finite].float(), atol=1e-4), (b, t)
            else:
                assert bool(torch.isneginf(w).all()), (b, t)
    assert min(ends) < steps  # some row finished before the others


class Recorder:
    """A streamer that takes batches (HF's own streamers take one row) and records what it is given."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamer_batch_follows_hf(model, tok):
    """HF's loop hands a streamer one token per row and step, and HF's streamers raise for batch > 1; selfspec's rows
    advance by different counts per step, so a batched call with a streamer runs the plain generate (warning once):
    HF's streamers raise HF's own clear error, a streamer of the user's gets exactly what HF gives it."""
    import selfspec.hf

    selfspec.hf._warned.clear()
    enc = batch_of(tok)
    with pytest.raises(ValueError, match="only supports batch size 1"):
        model.generate(**enc, max_new_tokens=5, do_sample=False, streamer=TextStreamer(tok))
    plain = Recorder()
    model.generate(**enc, max_new_tokens=12, do_sample=False, streamer=plain)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    try:
        with pytest.warns(UserWarning, match="streamer with batch size > 1"), \
                pytest.raises(ValueError, match="only supports batch size 1"):
            model.generate(**enc, max_new_tokens=5, do_sample=False, streamer=TextStreamer(tok))
        wrapped = Recorder()
        model.generate(**enc, max_new_tokens=12, do_sample=False, streamer=wrapped)
        assert model.selfspec.last_stats is None and "streamer" in model.selfspec.last_fallback
        single = Recorder()  # batch 1 stays speculative
        model.generate(**ids_of(tok), max_new_tokens=12, do_sample=False, streamer=single)
        assert model.selfspec.last_stats is not None and single.ends == 1
    finally:
        selfspec.unwrap(model)
    assert len(wrapped.puts) == len(plain.puts) and wrapped.ends == plain.ends == 1
    assert all(torch.equal(a, b) for a, b in zip(plain.puts, wrapped.puts))


# --- pipeline ---------------------------------------------------------------------------------------------------

def test_pipeline_strings_chats_batches(model, tok, caplog):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    chats = [[{"role": "user", "content": p}] for p in prompts]

    def run(m):
        pipe = tf.pipeline("text-generation", model=m, tokenizer=tok)
        kw = dict(max_new_tokens=12, do_sample=False)
        return ([o[0]["generated_text"] for o in pipe(prompts, **kw)],
                [o[0]["generated_text"][-1]["content"] for o in pipe(chats, **kw)],
                [o[0]["generated_text"] for o in pipe(prompts, batch_size=3, **kw)],
                pipe(prompts[0], max_new_tokens=6, do_sample=False, repetition_penalty=1.2)[0]["generated_text"])

    with caplog.at_level(logging.ERROR):
        plain, wrapped = both(model, run)
    assert plain == wrapped
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# --- save / load ------------------------------------------------------------------------------------------------

def test_save_load_round_trip(tmp_path):
    m = make_model("llama", 4)
    selfspec.wrap(m, exit_layer=3, max_draft_tokens=5, draft_confidence_threshold=0.2)
    m.selfspec.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["selfspec_config.json"]  # the untrained exit has no weights to write
    selfspec.unwrap(m)
    selfspec.wrap(m, str(tmp_path))
    assert (m.selfspec.config.exit_layer, m.selfspec.config.max_draft_tokens) == (3, 5)
    assert m.selfspec.config.draft_confidence_threshold == 0.2


def test_heads_for_another_model_rejected(tmp_path):
    a = make_model("llama", 4, seed=0)
    selfspec.wrap(a, exit_layer=2)
    a.selfspec.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="saved for another model.*lm_head_fingerprint"):
        selfspec.wrap(make_model("llama", 4, seed=1), str(tmp_path))
    with pytest.raises(ValueError, match="saved for another model.*num_layers: saved 4, this model 6"):
        selfspec.wrap(make_model("llama", 6, seed=0), str(tmp_path))
    same_weights_other_dtype = make_model("llama", 4, seed=0, dtype=torch.float32)
    selfspec.wrap(same_weights_other_dtype, str(tmp_path))  # a float32 copy of the same weights loads
