"""The draft model's vocabulary check compares what the tokenizers map, not embedding row counts: models that share
a tokenizer but pad their embeddings to different row counts (Qwen2.5-0.5B: 151,936 rows, Qwen2.5-7B: 152,064)
draft and decode exactly; real mismatches are refused with a one-line error that names the difference."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf

import selfspec
from tiny_tokenizer import tiny_tokenizer

TOK = tiny_tokenizer()  # 108 ids
GEN = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "Once upon a time in the west"]


def _target(rows: int, layers: int = 4):
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=rows, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)
    model = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():  # small output projections: the early layers' guesses often agree with the full model
        for name, module in model.named_modules():
            if name.endswith(("o_proj", "down_proj")):
                module.weight.mul_(0.3)
    return model.double().eval()


def _draft(target, rows: int, layers: int = 2):
    """The target's first layers with its embeddings cut or padded to `rows` (the same tokenizer's ids)."""
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    draft.resize_token_embeddings(rows, mean_resizing=False)
    return draft.double().eval()


def _batch():
    return TOK(TEXTS, return_tensors="pt", padding=True)


@pytest.mark.parametrize("target_rows,draft_rows", [(128, 112), (112, 128)])
def test_same_tokenizer_padded_differently_decodes_exactly(target_rows, draft_rows):
    target = _target(target_rows)
    draft = _draft(target, draft_rows)
    enc = _batch()
    ref = target.generate(**enc, **GEN)
    accepted = 0
    for how in ("wrap", "generate"):  # the tokenizer given to wrap, or to the generate call
        selfspec.wrap(target, drafter=draft, exit_layer=2, max_draft_tokens=3, **({"tokenizer": TOK} if how == "wrap"
                                                                                   else {}))
        try:
            out = target.generate(**enc, **GEN, **({"tokenizer": TOK} if how == "generate" else {}))
            accepted += target.selfspec.last_stats.accepted_tokens
        finally:
            selfspec.unwrap(target)
        assert torch.equal(out, ref), how
    assert accepted > 0  # the draft model's proposals were used, not just rejected


def test_padded_rows_without_a_tokenizer_are_refused_with_the_fix():
    target = _target(128)
    selfspec.wrap(target, drafter=_draft(target, 112), exit_layer=2)
    try:
        with pytest.raises(ValueError, match=r"LM head rows differ: target 128, draft 112.*tokenizer=tok") as err:
            target.generate(**_batch(), **GEN)
    finally:
        selfspec.unwrap(target)
    assert "\n" not in str(err.value)


def test_different_tokenizers_are_refused():
    target = _target(128)
    other = tiny_tokenizer(extra_tokens=["zz", "qq"])  # the same ids below 108, two tokens more
    given = [(dict(tokenizer=TOK, draft_tokenizer=other), {}),  # to wrap
             ({}, dict(tokenizer=TOK, assistant_tokenizer=other))]  # to the generate call, as HF names them
    for to_wrap, to_generate in given:
        selfspec.wrap(target, drafter=_draft(target, 128), exit_layer=2, **to_wrap)
        try:
            with pytest.raises(ValueError, match=r"vocabulary \(the tokenizers differ in 2 of 108 tokens, e.g. 'zz'"
                               ) as err:
                target.generate(**_batch(), **GEN, **to_generate)
        finally:
            selfspec.unwrap(target)
        assert "\n" not in str(err.value)


def test_a_model_without_rows_for_every_token_is_refused():
    target = _target(128)
    selfspec.wrap(target, drafter=_draft(target, 100), exit_layer=2, tokenizer=TOK)
    try:
        with pytest.raises(ValueError, match=r"the tokenizer has ids up to 107 but the draft model has 100 LM head"):
            target.generate(**_batch(), **GEN)
    finally:
        selfspec.unwrap(target)
