"""A verdict for every place where a speculative output parts from plain `generate`.

In float32 the verifier is bit-exact: any difference is a bug. In bfloat16 / float16 it cannot be: a model's
1-token pass (what plain `generate` runs at every step) and its multi-token passes (what any verifier runs,
Hugging Face's own assisted generation included) round differently, so greedy decoding can pick another token
wherever the top two logits are closer than that rounding. At the first differing position i, with `a` the
plain model's token and `b` the other one:

    gap         = l1[a] - l1[b]                   l1: the plain 1-token pass's logits at i (those that chose a)
    discrepancy = max_v |l1[v] - lm[v]|           lm: logits at i from multi-token passes over the same prefix
    near-tie    : gap <= 2 * discrepancy          (each of the two logits may move by the discrepancy)
    differs     : otherwise, a bug

The multi-token passes are one pass over the whole prefix and a cached prefix followed by a chunk of up to
`chunk` tokens (the shape of a verify pass); the larger discrepancy counts.

In a left-padded batch, l1 comes from the run that produced the reference: plain `generate` over the same padded
batch, the row's own logits there. Padding and the batch's other rows change a half-precision row's rounding
too, so a row's unpadded logits may not even choose the reference's tokens.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..draft_length import copy_budget

IDENTICAL, NEAR_TIE, DIFFERS = "identical", "near-tie", "differs"


@dataclass
class Verdict:
    kind: str  # near-tie or differs
    index: int  # first differing generated token
    expected: int | None  # plain generate's token there (None: plain had ended)
    got: int | None
    gap: float | None  # l1[expected] - l1[got]
    gap_multi: float | None  # the same gap in the multi-token pass that moved most
    discrepancy: float | None  # max |l1 - lm| over the vocabulary at that position

    def to_dict(self) -> dict:
        return asdict(self)

    def why(self) -> str:
        """Why the verdict is what it is, in judge's terms: one of its two DIFFERS without a gap, or the gap
        against the rounding."""
        if self.expected is None or self.got is None:
            return "one output ended where the other went on"
        if self.gap is None:
            return "plain generate's own logits there choose another token: it does not reproduce itself"
        sign = "<=" if self.kind == NEAR_TIE else ">"
        return f"gap {self.gap:.3f} {sign} 2 x rounding {self.discrepancy:.3f}"


def logit_gap(logits: torch.Tensor, a: int, b: int) -> float:
    """(V,) logits -> logits[a] - logits[b] in float32."""
    return float(logits[a].float() - logits[b].float())


def decide(gap: float, discrepancy: float) -> str:
    """The rule itself: a near-tie is a gap that the model's own rounding between pass shapes can close."""
    return NEAR_TIE if gap <= 2.0 * discrepancy else DIFFERS


class PlainLogits:
    """The plain model's 1-token-pass logits along its own greedy output, one `generate` per prompt, cached
    (every method compared on a prompt shares them)."""

    def __init__(self, model, generate_kwargs: dict):
        self.model, self.kwargs = model, generate_kwargs
        self._cache: dict[tuple, torch.Tensor] = {}
        self._batch: tuple[tuple, torch.Tensor] | None = None  # the last batch's (key, (T, B, V) logits)

    @torch.no_grad()
    def _generate_logits(self, ids: torch.Tensor, mask: torch.Tensor, max_new: int) -> torch.Tensor:
        from transformers import GenerationMixin

        out = GenerationMixin.generate(  # the class's generate: plain even if the model is wrapped
            self.model, ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, output_logits=True,
            return_dict_in_generate=True, **self.kwargs)
        return torch.stack([step.float().cpu() for step in out.logits])  # (T, B, V)

    def at_row(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row: int, index: int,
               max_new: int) -> torch.Tensor:
        """(V,) raw logits with which plain greedy `generate`, run over the whole left-padded batch, chose token
        `index` of row `row`. Only the last batch is kept: the bench judges a batch's rows before the next."""
        key = (tuple(map(tuple, input_ids.tolist())), tuple(map(tuple, attention_mask.tolist())), max_new)
        if self._batch is None or self._batch[0] != key:
            self._batch = (key, self._generate_logits(input_ids.to(self.model.device),
                                                      attention_mask.to(self.model.device), max_new))
        return self._batch[1][index, row]

    @torch.no_grad()
    def at(self, prompt: list[int], index: int, max_new: int) -> torch.Tensor:
        """(V,) raw logits with which plain greedy `generate` chose its token `index` after `prompt`."""
        key = tuple(prompt)
        if key not in self._cache:
            ids = torch.tensor([prompt], device=self.model.device)
            self._cache[key] = self._generate_logits(ids, torch.ones_like(ids), max_new)[:, 0]  # (T, V)
        return self._cache[key][index]


@torch.no_grad()
def multi_token_logits(model, prefix: list[int], chunk: int) -> list[torch.Tensor]:
    """(V,) logits for the token after `prefix` from two multi-token pass shapes: one pass over the whole
    prefix, and the prefix minus its last `chunk` tokens cached, then those tokens in one pass."""
    from transformers import DynamicCache

    ids = torch.tensor([prefix], device=model.device)
    whole = model(ids).logits[0, -1].float().cpu()
    c = min(chunk, len(prefix) - 1)
    if c < 1:
        return [whole]
    cache = DynamicCache(config=model.config)
    model(ids[:, :-c], cache=cache, use_cache=True)
    split = model(ids[:, -c:], cache=cache, use_cache=True).logits[0, -1].float().cpu()
    return [whole, split]


def first_difference(got: list[int], want: list[int]) -> int | None:
    """Index of the first differing token (or of the end of the shorter list), None when equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def verify_chunk(config) -> int:
    """Most tokens one verify pass of a SelfSpecConfig runs (the pending token plus a chain of K, or of a run past K
    while it copies, or a tree's nodes): the pass shape whose rounding a half-precision near-tie is judged against."""
    chain = copy_budget(config.copy_draft_tokens, config.max_draft_tokens, remaining=math.inf)  # no step cut short
    nodes = config.draft_tree_size if config.draft_tree_top_k > 1 else chain
    return max(nodes, chain) + 1


def judge(model, plain: PlainLogits, prompt: list[int], got: list[int], want: list[int], max_new: int,
          chunk: int = 8, batch_row: tuple | None = None) -> Verdict | None:
    """Verdict for `got` against plain greedy's `want` after `prompt`; None when they are identical. With
    `batch_row` = (input_ids, attention_mask, row) `want` came from plain `generate` over that left-padded batch,
    and its logits there are the ones judged against."""
    i = first_difference(got, want)
    if i is None:
        return None
    a = want[i] if i < len(want) else None
    b = got[i] if i < len(got) else None
    if a is None or b is None:  # one output ended where the other went on without a differing token
        return Verdict(DIFFERS, i, a, b, None, None, None)
    l1 = plain.at_row(*batch_row, i, max_new) if batch_row is not None else plain.at(prompt, i, max_new)
    if int(l1.argmax()) != a:  # plain generate does not reproduce itself: nothing to compare against
        return Verdict(DIFFERS, i, a, b, None, None, None)
    passes = multi_token_logits(model, prompt + want[:i], chunk)
    moved = max(passes, key=lambda lm: float((l1 - lm).abs().max()))
    discrepancy = float((l1 - moved).abs().max())
    gap = logit_gap(l1, a, b)
    return Verdict(decide(gap, discrepancy), i, a, b, gap, logit_gap(moved, a, b), discrepancy)
