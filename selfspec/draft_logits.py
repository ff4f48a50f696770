"""A head's draft logits: scoring the vocabulary (or a head's draft vocabulary) through the model's LM head, and
`DraftLogits`, the value a drafter chooses its tokens from (a greedy draft reads V_draft + 1 columns, sampling and
logits processors the full row)."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .arch.base import ArchAdapter
from .distributed import is_dtensor
from .draft_length import copies
from .tp_weights import replicated_rows

if TYPE_CHECKING:
    from .heads import ExitHead


def full_vocab_logits(sub: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """(..., V_draft) head logits -> (..., V), -inf outside the head's draft vocabulary."""
    if vocab_ids is None:
        return sub
    full = sub.new_full((*sub.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(sub.dim() - 1, vocab_ids.to(sub.device), sub)


@dataclass
class DraftLogits:
    """A head's float draft logits at (...) positions, kept as scored: `sub` (..., V_draft) over its draft
    vocabulary `vocab_ids` (V_draft,) (None: the whole vocabulary), and a copy head's candidate `token` (...) with
    its logit `copy` (...) (-inf: none), which replaces whatever the vocabulary gave that token. Every other token
    is -inf. The full (..., V) row is for sampling and logits processors; a greedy draft needs V_draft + 1 columns."""

    sub: torch.Tensor
    vocab_ids: torch.Tensor | None
    vocab_size: int
    token: torch.Tensor | None = None
    copy: torch.Tensor | None = None
    match: torch.Tensor | None = None  # (...) the candidate's match length (draft_length.copies reads it)

    def last(self) -> "DraftLogits":
        """(B, T, ...) positions -> the last one's (B, ...)."""
        pick = (lambda x: None if x is None else x[:, -1])
        return DraftLogits(self.sub[:, -1], self.vocab_ids, self.vocab_size, pick(self.token), pick(self.copy),
                           pick(self.match))

    def copying(self, token: torch.Tensor) -> torch.Tensor:
        """(...) whether the drafts `token` copy the text (draft_length.copies); all False without a candidate."""
        if self.token is None:
            return torch.zeros_like(token, dtype=torch.bool)
        return copies(token, self.token, self.match)

    def full(self) -> torch.Tensor:
        """(..., V) logits over the full vocabulary."""
        full = full_vocab_logits(self.sub, self.vocab_ids, self.vocab_size)
        if self.token is None:
            return full
        where = self.token.clamp(min=0)[..., None]
        kept = full.gather(-1, where)[..., 0]
        return full.scatter(-1, where, torch.where(self.copy > float("-inf"), self.copy, kept)[..., None])

    def columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(values (..., C), ids (..., C)): the logits that can be finite and their token ids, in id order but for
        a candidate outside the draft vocabulary, last. C = V_draft + 1 with a candidate, V_draft without."""
        if self.vocab_ids is None:
            values = self.full()
            return values, torch.arange(values.shape[-1], device=values.device).expand_as(values)
        ids = self.vocab_ids.to(self.sub.device).expand_as(self.sub)
        if self.token is None:
            return self.sub, ids
        # the candidate takes its vocabulary slot where it has one, else the extra column
        slot = _slots(self.vocab_ids, self.vocab_size, self.sub.device)[self.token.clamp(min=0)][..., None]
        values = torch.cat([self.sub, torch.full_like(self.sub[..., :1], float("-inf"))], dim=-1)
        kept = values.gather(-1, slot)[..., 0]
        values.scatter_(-1, slot, torch.where(self.copy > float("-inf"), self.copy, kept)[..., None])
        return values, torch.cat([ids, self.token[..., None]], dim=-1)

    def greedy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token (...), top (...)): the argmax of `full()` (among equal logits the smallest id, as argmax picks)
        and its softmax probability, from the finite columns alone."""
        values, ids = self.columns()
        top = values.amax(-1, keepdim=True)
        token = torch.where(values == top, ids, self.vocab_size).amin(-1)
        return token, torch.softmax(values, dim=-1).amax(-1)

    def top_k(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities (..., k), tokens (..., k)): the k most probable tokens of `full()`, best first, from
        the finite columns alone (a tree node's children)."""
        values, ids = self.columns()
        if k > values.shape[-1]:  # fewer columns than children asked for: rank the full row
            return torch.log_softmax(self.full(), dim=-1).topk(k, dim=-1)
        logp, index = torch.log_softmax(values, dim=-1).topk(k, dim=-1)
        return logp, ids.gather(-1, index)


_SLOTS: dict = {}  # id(vocab_ids) -> (a weak reference to it, (V,) each token's column: its slot, else V_draft)


def _slots(vocab_ids: torch.Tensor, vocab_size: int, device) -> torch.Tensor:
    entry = _SLOTS.get(id(vocab_ids))
    if entry is None or entry[0]() is not vocab_ids or entry[1].device != torch.device(device):
        slots = torch.full((vocab_size,), vocab_ids.numel(), dtype=torch.long, device=device)
        slots[vocab_ids.to(device)] = torch.arange(vocab_ids.numel(), device=device)
        entry = _SLOTS[id(vocab_ids)] = (weakref.ref(vocab_ids), slots)
    return entry[1]


def draft_scores(head: ExitHead, adapter: ArchAdapter, normed: torch.Tensor, vocab_size: int, token=None,
                 match=None) -> DraftLogits:
    """(B, T, H) a head's normed outputs -> its DraftLogits at (B, T), with a copy head's candidates `token` /
    `match` (B, T) scored when given: what the drafter, the cost model's profile and eval_heads' replay all draft
    from."""
    sub = lm_logits(adapter, normed, head.vocab_ids).float()
    if token is None or not head.copy_max:
        return DraftLogits(sub, head.vocab_ids, vocab_size)
    copy = head.copy_logit(normed, adapter, token, match)
    return DraftLogits(sub, head.vocab_ids, vocab_size, token, copy, match)


def draft_logits(head: ExitHead, adapter: ArchAdapter, normed: torch.Tensor, vocab_size: int, token=None,
                 match=None) -> torch.Tensor:
    """draft_scores as (B, T, V) float logits over the full vocabulary (-inf outside the head's)."""
    return draft_scores(head, adapter, normed, vocab_size, token, match).full()


def lm_logits(adapter: ArchAdapter, normed: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """The LM head on final-normed states (B, T, H), over the full vocabulary or only `vocab_ids`, also when the
    LM head's weight is a DTensor (there the full-vocabulary head gathers its own output)."""
    head = adapter.lm_head
    if vocab_ids is None or not is_dtensor(getattr(head, "weight", None)):
        return adapter.logits(normed, vocab_ids)
    rows, bias = replicated_rows(head, vocab_ids)
    out = nn.functional.linear(normed.to(rows.device), rows, bias)
    return out if adapter.home is None else out.to(adapter.home)


def token_logits(adapter: ArchAdapter, normed: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """The LM head's float logit of one token per state: (..., H) final-normed states, (...) token ids -> (...).
    A plain weight gives each its row's dot product (a copy head scores one candidate per drafted token, and a
    call through the LM head with a fresh row set would gather and cache those rows first); other weights (sharded,
    quantized, offloaded) go through lm_logits with the tokens as rows, each state reading its own column."""
    weight = getattr(adapter.lm_head, "weight", None)
    plain = (isinstance(weight, torch.Tensor) and not is_dtensor(weight) and weight.is_floating_point()
             and weight.device.type != "meta" and getattr(adapter.lm_head, "bias", None) is None)
    if not plain:
        n = token.numel()
        out = lm_logits(adapter, normed.reshape(1, n, normed.shape[-1]), token.reshape(n))[0]  # (N, N)
        return out.diagonal().float().view(token.shape)
    dtype = torch.promote_types(weight.dtype, torch.float32)
    rows = weight[token.to(weight.device)]  # (..., H)
    out = torch.linalg.vecdot(normed.to(weight.device, dtype), rows.to(dtype))
    out = adapter.cap_logits(out)
    return out if adapter.home is None else out.to(adapter.home)
