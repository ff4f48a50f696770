"""Greedy identity on the real SmolLM2-135M-Instruct weights, on Spec-Bench prompts."""
from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.prompts import chat_input_ids, load_prompts

pytestmark = pytest.mark.slow
NEW = 48


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tok = smollm2
    chosen = load_prompts(categories=["translation", "qa"], limit_per_category=1)
    return [chat_input_ids(tok, p.text) for p in chosen]


def test_greedy_identity_on_spec_bench(smollm2, prompts):
    model, tok = smollm2
    for ids in prompts:
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        for exit_layer, k in ((8, 4), (20, 6)):
            selfspec.wrap(model, exit_layer=exit_layer, max_draft_tokens=k)
            try:
                out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
                stats = model.selfspec.last_stats
            finally:
                selfspec.unwrap(model)
            assert torch.equal(out, ref), (exit_layer, k, tok.decode(out[0, ids.shape[1]:]))
            assert stats.new_tokens == ref.shape[1] - ids.shape[1]


def test_padded_batch_on_real_model(smollm2, prompts):
    model, tok = smollm2
    texts = [tok.decode(p[0]) for p in prompts[:2]]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    rows = [model.generate(tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"],
                           max_new_tokens=32, do_sample=False) for t in texts]
    selfspec.wrap(model, exit_layer=24, max_draft_tokens=4)
    try:
        out = model.generate(**batch, max_new_tokens=32, do_sample=False)
    finally:
        selfspec.unwrap(model)
    width = batch["input_ids"].shape[1]
    for r, ref in enumerate(rows):
        new = ref[0, ref.shape[1] - (ref.shape[1] - len(tok(texts[r], add_special_tokens=False)["input_ids"])):]
        assert out[r, width : width + new.numel()].tolist() == new.tolist()


@pytest.mark.parametrize("design", ["shipped", "shipped-tree", "attn-early", "attn-top"])
def test_greedy_identity_with_each_head_design(smollm2, prompts, design):
    """The shipped head at its own exit (chains and trees) and both attention-head contexts (a perturbed copy of
    layer 8, its drafts neither all right nor all wrong) keep SmolLM2's greedy output unchanged."""
    from selfspec.heads import AttentionHead
    from selfspec.pretrained import shipped_dir

    model, tok = smollm2
    ids = prompts[0]
    ref = model.generate(ids, max_new_tokens=32, do_sample=False)
    if design.startswith("shipped"):
        selfspec.wrap(model, shipped_dir("smollm2-135m"), drafter="early_exit", max_draft_tokens=4,
                      draft_confidence_threshold=0.0, draft_tree_top_k=3 if design.endswith("tree") else 1)
    else:
        selfspec.wrap(model, exit_layer=8, max_draft_tokens=4)
        head = AttentionHead.from_model(model.selfspec.adapter, 8, context=design.split("-")[1])
        torch.manual_seed(0)
        with torch.no_grad():
            for p in head.layer.parameters():
                p.mul_(1 + 0.05 * torch.randn_like(p))
        model.selfspec.add_head(head)
    out, stats = _generate_then_unwrap(model, ids, 32)
    assert torch.equal(out, ref), tok.decode(out[0, ids.shape[1]:])
    assert stats.drafted_tokens > 0


def _generate_then_unwrap(model, ids, new_tokens: int):
    """(output, stats) of a greedy generate with the wrapped model, which is unwrapped after, whatever happens."""
    try:
        return model.generate(ids, max_new_tokens=new_tokens, do_sample=False), model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)


def test_greedy_identity_with_copy_runs(smollm2, prompts):
    """The shipped copy head's chain running past K while it copies (copy_draft_tokens) keeps SmolLM2's greedy
    output on a translation prompt, and some of its steps do draft past K."""
    from selfspec.pretrained import shipped_dir

    model, tok = smollm2
    ids = prompts[0]
    ref = model.generate(ids, max_new_tokens=64, do_sample=False)
    k = 2
    selfspec.wrap(model, shipped_dir("smollm2-135m"), drafter="early_exit", max_draft_tokens=k, copy_draft_tokens=16)
    out, stats = _generate_then_unwrap(model, ids, 64)
    assert torch.equal(out, ref), tok.decode(out[0, ids.shape[1]:])
    assert stats.drafted_tokens > k * (stats.verify_steps - 1), stats
