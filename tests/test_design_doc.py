"""docs/design.md's code runs as written: the runner's passes by hand give transformers' logits, and the drafter of
the contract section keeps plain generate's output."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

import selfspec
from conftest import make_model, padded_batch

DESIGN = pathlib.Path(__file__).resolve().parent.parent / "docs" / "design.md"


def _blocks() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DESIGN.read_text(), flags=re.S)
    assert len(blocks) == 2, "docs/design.md holds two python blocks: the runner by hand, the example drafter"
    return blocks


def _example_drafter():
    """The class defined by the page's drafter block."""
    scope: dict = {}
    exec(compile(_blocks()[1], str(DESIGN), "exec"), scope)
    return scope["LastOccurrenceDrafter"]


def test_the_runner_by_hand_gives_transformers_logits():
    """The block's own asserts compare with transformers' forward; a runner that skipped the drafted token's layers
    [0, 2) would leave those layers a slot short, and its logits would differ."""
    scope: dict = {}
    exec(compile(_blocks()[0], str(DESIGN), "exec"), scope)
    assert scope["got"].shape == (1, 6, 64)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_pages_drafter_keeps_plain_generates_output(family):
    """fp32 greedy on a padded batch whose rows repeat themselves, so that the drafter proposes and some of its
    drafts are accepted, some rejected: the tokens equal Hugging Face's own generate."""
    model = make_model(family, 4, dtype=torch.float32)
    ids, mask = padded_batch(seed=4, vocab=12)  # a 12-token alphabet: the last token recurs early and often
    gen = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    want = model.generate(ids, **gen)
    selfspec.wrap(model, drafter=_example_drafter()(), max_draft_tokens=6)
    try:
        got = model.generate(ids, **gen)
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0, stats
    assert torch.equal(got, want)
