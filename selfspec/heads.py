"""Exit heads: map layer-E hidden states (B, T, H) to draft logits (B, T, V_draft).

A head may score only a subset of the vocabulary (`vocab_ids`, (V_draft,) ids into the full vocabulary);
the engine then drafts only tokens of that subset, with q = 0 elsewhere, which keeps verification exact.
Heads share the model's final norm and LM head through the adapter and never register them as their own
parameters, so saving a head writes only what it adds.
"""
from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .arch.base import ArchAdapter
from .distributed import is_dtensor
from .draft_length import copies
from .lookup import prefix_copy_candidates


class ExitHead(nn.Module):
    """Base: the model's own final norm + LM head applied at layer E (LayerSkip's exit; no parameters)."""

    kind = "norm"
    stateful = False  # True for heads with a KV cache of their own (the attention adapter)
    reads_top = False  # True for heads that also read the previous position's final-normed state (`prev_top`)
    copy_max = 0  # > 0 for heads that also score prompt lookup's candidate (its n-gram up to this long)

    def __init__(self, exit_layer: int, vocab_ids: torch.Tensor | None = None):
        super().__init__()
        self.exit_layer = exit_layer
        self.register_buffer("vocab_ids", None if vocab_ids is None else vocab_ids.long(), persistent=True)

    def transform(self, hidden: torch.Tensor, adapter: ArchAdapter, prev_top=None) -> torch.Tensor:
        """Residual-stream adapter before the shared norm; identity for the plain exit."""
        return hidden

    def normed(self, hidden: torch.Tensor, adapter: ArchAdapter, prev_top=None) -> torch.Tensor:
        """(B, T, H) final-normed output, the state the draft logits come from (a top-reading head's estimate of
        the final state there, which the next draft reads as its `prev_top`). In a compiled decode call it runs
        compiled (compiled.py); it is computed the same way either way (normed_eager)."""
        if adapter.compiled is not None and not self.stateful:
            out = adapter.compiled.head_normed(self, adapter, hidden, prev_top)
            if out is not None:
                return out
        return self.normed_eager(hidden, adapter, prev_top)

    def normed_eager(self, hidden: torch.Tensor, adapter: ArchAdapter, prev_top=None) -> torch.Tensor:
        """`normed`, op by op: what the compiled step traces."""
        # heads that read no final state keep the two-argument transform (subclasses written for it still work)
        h = self.transform(hidden, adapter, prev_top) if self.reads_top else self.transform(hidden, adapter)
        return adapter.final_norm(h)

    def forward(self, hidden: torch.Tensor, adapter: ArchAdapter, prev_top=None) -> torch.Tensor:
        return lm_logits(adapter, self.normed(hidden, adapter, prev_top), self.vocab_ids)

    def token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into this head's logits (any shape) -> token ids of the full vocabulary."""
        return idx if self.vocab_ids is None else self.vocab_ids.to(idx.device)[idx]

    def spec(self) -> dict:
        """JSON-able description from which `build_head` rebuilds the module before loading weights."""
        return {"kind": self.kind, "exit_layer": self.exit_layer,
                "draft_vocab_size": None if self.vocab_ids is None else int(self.vocab_ids.numel())}


HEAD_KINDS: dict[str, type[ExitHead]] = {"norm": ExitHead}


def register_head(cls: type[ExitHead]) -> type[ExitHead]:
    HEAD_KINDS[cls.kind] = cls
    return cls


def build_head(spec: dict, adapter: ArchAdapter) -> ExitHead:
    kind = spec.get("kind", "norm")
    if kind not in HEAD_KINDS:
        raise ValueError(f"Unknown exit head kind {kind!r}; known kinds: {sorted(HEAD_KINDS)}.")
    return HEAD_KINDS[kind].from_spec(spec, adapter) if hasattr(HEAD_KINDS[kind], "from_spec") else \
        HEAD_KINDS[kind](spec["exit_layer"], _vocab_placeholder(spec))


def _vocab_placeholder(spec: dict) -> torch.Tensor | None:
    # the real ids arrive with load_state_dict; the buffer only needs the right shape
    size = spec.get("draft_vocab_size")
    return None if size is None else torch.zeros(size, dtype=torch.long)


CONTEXTS = ("early", "top")


@register_head
class MLPHead(ExitHead):
    """Residual MLP adapter before the shared norm + LM head: h + down(silu(up(rmsnorm(h)))).

    `down` starts at zero, so an untrained MLP head is exactly the plain exit (design 1) and training can only
    move away from it where that helps. With context="top" it also reads `prev_top`, the final-normed state of
    the position before (EAGLE's feature): the verifier's own for a step's first draft, the head's own estimate
    (`normed`) for later ones. That state holds what the whole model knew one token ago, which layer E alone
    does not; it enters the residual through `top_in` (zero at first, so an untrained top head is the plain exit
    too) and the MLP's hidden layer through `top_up`.

    With `copy_max` > 0 it is also a copy head: what an MLP over one position cannot do is look a token up in the
    prompt, which is where most of the eval split's missed tokens come from. The drafter hands it, per draft, the
    token that followed the most recent earlier occurrence of the text's last n tokens (prompt lookup's candidate,
    n <= copy_max, the longest that occurs) and n; `copy_logit` gives that token its own LM-head logit plus a
    learned trust `copy_bias[n] + copy_gate(normed state)`. Both start at zero and are fitted by train.train_copy.
    The draft is still a distribution the head chose, so verification stays exact.
    """

    kind = "mlp"

    def __init__(self, exit_layer: int, hidden_size: int, rank: int | None = None,
                 vocab_ids: torch.Tensor | None = None, eps: float = 1e-6, context: str = "early",
                 copy_max: int = 0):
        super().__init__(exit_layer, vocab_ids)
        if context not in CONTEXTS:
            raise ValueError(f"MLP head context must be one of {CONTEXTS}, got {context!r}.")
        if not isinstance(copy_max, int) or isinstance(copy_max, bool) or not 0 <= copy_max <= 16:
            raise ValueError(f"MLP head copy_max must be an integer in [0, 16] (0: no copy candidate), got "
                             f"{copy_max!r}.")
        self.copy_max = copy_max
        self.hidden_size, self.rank, self.context = hidden_size, rank or 2 * hidden_size, context
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.up = nn.Linear(hidden_size, self.rank, bias=False)
        self.down = nn.Linear(self.rank, hidden_size, bias=False)
        nn.init.zeros_(self.down.weight)
        if context == "top":
            self.top_norm = nn.RMSNorm(hidden_size, eps=eps)
            self.top_in = nn.Linear(hidden_size, hidden_size, bias=False)
            self.top_up = nn.Linear(hidden_size, self.rank, bias=False)
            nn.init.zeros_(self.top_in.weight)
        if copy_max:
            self.copy_bias = nn.Parameter(torch.zeros(copy_max + 1))  # trust in an n-token match, index n
            self.copy_gate = nn.Linear(hidden_size, 1, bias=False)  # and how the state moves it
            nn.init.zeros_(self.copy_gate.weight)

    @property
    def reads_top(self) -> bool:
        return self.context == "top"

    def transform(self, hidden, adapter, prev_top=None):
        dtype = self.up.weight.dtype
        pre, out = self.up(self.norm(hidden.to(dtype))), hidden
        if self.reads_top:
            if prev_top is None:
                raise ValueError("This MLP head reads the previous position's final state: pass prev_top.")
            t = self.top_norm(prev_top.to(hidden.device, dtype))
            pre = pre + self.top_up(t)
            out = out + self.top_in(t).to(hidden.dtype)
        return out + self.down(nn.functional.silu(pre)).to(hidden.dtype)

    def spec(self) -> dict:
        return {**super().spec(), "hidden_size": self.hidden_size, "rank": self.rank, "context": self.context,
                **({"copy_max": self.copy_max} if self.copy_max else {})}

    @classmethod
    def from_spec(cls, spec: dict, adapter: ArchAdapter) -> "MLPHead":
        if spec["hidden_size"] != adapter.hidden_size:
            raise ValueError(f"MLP head for hidden size {spec['hidden_size']}, model has {adapter.hidden_size}.")
        return cls(spec["exit_layer"], spec["hidden_size"], spec["rank"], _vocab_placeholder(spec),
                   context=spec.get("context", "early"), copy_max=spec.get("copy_max", 0))

    def copy_score(self, own: torch.Tensor, normed: torch.Tensor, match: torch.Tensor) -> torch.Tensor:
        """The copy candidate's draft logit (...,): its own LM-head logit `own` (...,) plus the trust in a `match`
        (...,)-token suffix match, moved by the head's normed state (..., H) there."""
        weight = self.copy_gate.weight[0]  # (H,): a matrix-vector product
        gate = torch.matmul(normed.to(weight.dtype), weight)
        return own.float() + self.copy_bias[match.clamp(0, self.copy_max)].float() + gate.float()

    def copy_logit(self, normed: torch.Tensor, adapter: ArchAdapter, token: torch.Tensor,
                   match: torch.Tensor) -> torch.Tensor:
        """(B, T, H) normed states and their copy candidates `token` / `match` (B, T) -> (B, T) float draft logits
        of the candidates by `copy_score`, -inf where match is 0 (no candidate)."""
        own = token_logits(adapter, normed, token.clamp(min=0))
        return torch.where(match > 0, self.copy_score(own, normed, match), float("-inf"))


@register_head
class AttentionHead(ExitHead):
    """Attention adapter: a copy of one decoder layer run on the layer-E states, then the shared norm + LM head.

    It attends over earlier positions through a KV cache of its own whose slots mirror the shared cache (same
    slot table, same rollback). `context` says what fills that cache for verified positions:
      "early": their layer-E states (Kangaroo's adapter; the head sees one kind of input everywhere);
      "top":   their final-layer (final-normed) states, which verification computes anyway; only the positions
               being drafted use layer-E states. Top-layer features predict the next token far better (EAGLE),
               and here they cost nothing but one pass of this layer over the accepted tokens.
    Drafted tokens are still verified by the full model, so either way the output is exact.
    """

    kind = "attn"
    stateful = True

    def __init__(self, exit_layer: int, layer: nn.Module, source_layer: int, context: str = "early",
                 vocab_ids: torch.Tensor | None = None):
        super().__init__(exit_layer, vocab_ids)
        if context not in CONTEXTS:
            raise ValueError(f"attention head context must be one of {CONTEXTS}, got {context!r}.")
        self.source_layer, self.context = source_layer, context
        self.layer = layer
        for module in self.layer.modules():  # its KV goes to layer 0 of the head's own cache
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0

    @classmethod
    def from_model(cls, adapter: ArchAdapter, exit_layer: int, source_layer: int | None = None,
                   context: str = "early", vocab_ids: torch.Tensor | None = None) -> "AttentionHead":
        """A head whose layer starts as a copy of the model's layer `source_layer` (default: layer E itself,
        which already reads layer-E states)."""
        source = exit_layer if source_layer is None else source_layer
        if not 0 <= source < adapter.num_layers:
            raise ValueError(f"source_layer {source} outside [0, {adapter.num_layers - 1}].")
        layer = adapter.layers[source]
        if any(not p.is_floating_point() or p.device.type == "meta" for p in layer.parameters()):
            raise ValueError(
                f"An attention head copies decoder layer {source}, but its weights are quantized or offloaded. "
                "Build and train heads on the unquantized model, then load them into the quantized one.")
        return cls(exit_layer, _whole_copy(layer).requires_grad_(True), source, context, vocab_ids)

    @classmethod
    def from_spec(cls, spec: dict, adapter: ArchAdapter) -> "AttentionHead":
        if spec.get("hidden_size", adapter.hidden_size) != adapter.hidden_size:
            raise ValueError(f"Attention head for hidden size {spec['hidden_size']}, model has "
                             f"{adapter.hidden_size}.")
        return cls.from_model(adapter, spec["exit_layer"], spec["source_layer"], spec.get("context", "early"),
                              _vocab_placeholder(spec))

    def spec(self) -> dict:
        return {**super().spec(), "source_layer": self.source_layer, "context": self.context}

    def attend(self, hidden, adapter: ArchAdapter, positions, mask=None, cache=None) -> torch.Tensor:
        """The copied layer on (B, T, H) states at (B, T) positions; with a cache, appends to its layer 0."""
        return adapter.call_module(self.layer, self.source_layer, hidden, mask, positions,
                                   adapter.rotary(hidden, positions), cache)

    def forward(self, hidden, adapter: ArchAdapter, positions=None, mask=None) -> torch.Tensor:
        """Stateless use (training, teacher-forced evaluation): (B, T, H) states, causal unless `mask` is
        given -> (B, T, V_draft) logits."""
        b, t = hidden.shape[:2]
        if positions is None:
            positions = torch.arange(t, device=hidden.device).expand(b, t)
        if mask is None:
            mask = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()[None, None].expand(b, 1, t, t)
        return self.logits(self.attend(hidden, adapter, positions, mask), adapter)

    def logits(self, out: torch.Tensor, adapter: ArchAdapter) -> torch.Tensor:
        return lm_logits(adapter, adapter.final_norm(out), self.vocab_ids)

    def teacher_forced(self, early, top, adapter: ArchAdapter, lengths=None, round_len: int = 1,
                       offset: int = 0) -> torch.Tensor:
        """Draft logits (B, T, V_draft) at every position of right-padded sequences, each seeing the context it
        would see while drafting (training and the calibrator's acceptance profile).

        early, top: (B, T, H) layer-E and final-normed states at positions 0..T-1; lengths (B,) valid lengths.
        For context="top", positions are drafted in rounds of `round_len` starting at `offset`: a query at j,
        in the round that starts at r, sees final states before r and layer-E states from r to j. round_len=1
        is the first draft of every round (the verified text is all top states)."""
        b, t = early.shape[:2]
        device = early.device
        lengths = torch.full((b,), t, device=device) if lengths is None else lengths.to(device)
        j = torch.arange(t, device=device)
        valid = j[None, :] < lengths[:, None]  # (B, T) real keys
        if self.context == "early":
            mask = (j[None, :] <= j[:, None])[None] & valid[:, None, :]  # (B, T, T) causal
            return self.forward(early, adapter, j.expand(b, t), (mask | torch.eye(t, dtype=torch.bool,
                                                                                    device=device))[:, None])
        start = j - torch.remainder(j - offset, round_len)  # (T,) first position of each query's round
        sees_top = j[None, :] < start[:, None]  # (T, T): query j, key i
        sees_early = (j[None, :] >= start[:, None]) & (j[None, :] <= j[:, None])
        # keys: [top_0 .. top_T-1, early_0 .. early_T-1]; queries: the same layout, only the early half is used
        # (a top query sees only itself; its output is thrown away)
        mask = torch.zeros(b, 2 * t, 2 * t, dtype=torch.bool, device=device)
        mask[:, t:, :t] = sees_top[None] & valid[:, None, :]
        mask[:, t:, t:] = sees_early[None] & valid[:, None, :]
        mask |= torch.eye(2 * t, dtype=torch.bool, device=device)
        positions = torch.cat([j, j]).expand(b, 2 * t)
        out = self.attend(torch.cat([top, early], dim=1), adapter, positions, mask[:, None])
        return self.logits(out[:, t:], adapter)


def teacher_forced_logits(head: ExitHead, states, adapter: ArchAdapter, rows: slice) -> torch.Tensor:
    """(N, V_draft) draft logits at `rows` of one text, from HF's hidden states of it (embeddings, each layer's
    output, the last one final-normed): each row drafting the next token; an attention head sees the context
    of a round's first draft (final states before it)."""
    if head.stateful:
        return head.teacher_forced(states[head.exit_layer], states[-1], adapter)[0, rows]
    prev = previous_top(states[-1])[:, rows] if head.reads_top else None
    return head(states[head.exit_layer][:, rows], adapter, prev)[0]


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


def teacher_forced_candidates(head: ExitHead, text: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(token (N,), match (N,)) a copy head's candidates at `rows` of one text (1, T), each looked up in the text up
    to its row, as the drafter does (-1 and 0 where none), on the text's device."""
    found = prefix_copy_candidates(text[0, : rows.stop].tolist(), head.copy_max)
    token, match = (torch.tensor(c)[rows].to(text.device) for c in found)
    return token, match


def teacher_forced_copy_logits(head: ExitHead, states, adapter: ArchAdapter, text: torch.Tensor,
                               rows: slice, candidates: tuple | None = None) -> torch.Tensor:
    """(N, V) full-vocabulary draft logits of a copy head at `rows` of one text (1, T) from HF's hidden states of
    it, each row a step's first draft, with the candidates looked up in the text up to the row, as the drafter
    does (`candidates`: teacher_forced_candidates' own, when the caller has them already)."""
    prev = previous_top(states[-1])[:, rows] if head.reads_top else None
    normed = head.normed(states[head.exit_layer][:, rows], adapter, prev)  # (1, N, H)
    token, match = candidates or teacher_forced_candidates(head, text, rows)
    return draft_logits(head, adapter, normed, adapter.vocab_size, token[None].to(normed.device),
                        match[None].to(normed.device))[0]


def previous_top(top: torch.Tensor) -> torch.Tensor:
    """(B, T, H) final states -> the state before each position (zeros before the first): a top-reading head's
    `prev_top` in teacher-forced use."""
    return torch.cat([torch.zeros_like(top[:, :1]), top[:, :-1]], dim=1)


def frequent_token_ids(token_ids: torch.Tensor, size: int, always: list[int] | None = None) -> torch.Tensor:
    """The `size` most frequent ids of a (N,) token stream, plus `always` (e.g. EOS), sorted: a draft vocabulary."""
    counts = torch.bincount(token_ids.flatten().long())
    top = torch.argsort(counts, descending=True)[:size]
    top = top[counts[top] > 0]
    ids = torch.unique(torch.cat([top, torch.tensor(always or [], dtype=torch.long)]))
    return ids


# ----------------------------------------------------------------------------------------------------------------
# Tensor-parallel models (weights are DTensors, sharded over the ranks of a torchrun job). Heads are replicated:
# every rank holds all of a head and computes it alone, so drafting adds no collective per drafted token. The
# draft-vocabulary rows of a sharded LM head are gathered once (only those rows: 38 ms against 234 ms for the whole
# head) and cached. Measured on CPU/gloo, 2 ranks: scoring SmolLM2's 3580 draft rows
# (H = 576) from replicated rows took 0.15 ms per drafted token against 1.6 ms for each rank scoring the rows it
# holds plus an all-gather of the logits; at H = 2048 with 8192 rows the two were even (5.1 against 4.8 ms).
# Every function here that gathers is a collective: all ranks call it together, as the decode loop does.

def lm_logits(adapter: ArchAdapter, normed: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """The LM head on final-normed states (B, T, H), over the full vocabulary or only `vocab_ids`, also when the
    LM head's weight is a DTensor (there the full-vocabulary head gathers its own output)."""
    head = adapter.lm_head
    if vocab_ids is None or not is_dtensor(getattr(head, "weight", None)):
        return adapter.logits(normed, vocab_ids)
    rows, bias = _replicated_rows(head, vocab_ids)
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


def dense_rows(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """weight[rows] as a plain tensor. For a DTensor sharded by rows (an LM head under a tensor-parallel plan),
    each rank contributes the requested rows it holds and one all-gather assembles them; other layouts gather the
    whole tensor. Collective for a DTensor: every rank of its mesh must call it with the same rows."""
    if not is_dtensor(weight):
        return weight[rows.to(weight.device)]
    from torch.distributed.tensor import Shard

    weight = weight.detach()
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] != Shard(0):
        return weight.full_tensor()[rows.to(weight.to_local().device)]
    local = weight.to_local()
    rows = rows.to(local.device).long()
    group, world = mesh.get_group(), mesh.size()
    sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(world)]
    torch.distributed.all_gather(sizes, torch.tensor([local.shape[0]], device=local.device), group=group)
    bounds = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long, device=local.device), *sizes]), 0).tolist()
    owned = [(rows >= bounds[r]) & (rows < bounds[r + 1]) for r in range(world)]
    width = max(int(m.sum()) for m in owned)
    me = mesh.get_local_rank()
    mine = local[rows[owned[me]] - bounds[me]]
    padded = torch.zeros(width, *local.shape[1:], dtype=local.dtype, device=local.device)
    padded[: mine.shape[0]] = mine
    parts = [torch.empty_like(padded) for _ in range(world)]
    torch.distributed.all_gather(parts, padded, group=group)
    out = torch.empty(len(rows), *local.shape[1:], dtype=local.dtype, device=local.device)
    for r in range(world):
        out[owned[r]] = parts[r][: int(owned[r].sum())]
    return out


# id(vocab_ids) -> (weakref to vocab_ids, LM-head weight, its version, rows, bias rows): gathered once per draft
# vocabulary and LM head, dropped with the vocab_ids tensor, regathered if the weight changes
_TP_ROWS: dict[int, tuple] = {}


def _replicated_rows(head: nn.Module, vocab_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = head.weight
    key = id(vocab_ids)
    hit = _TP_ROWS.get(key)
    if hit is not None and hit[0]() is vocab_ids and hit[1] is weight and hit[2] == weight._version:
        return hit[3], hit[4]
    rows = dense_rows(weight, vocab_ids)
    bias = getattr(head, "bias", None)
    bias = None if bias is None else dense_rows(bias, vocab_ids)
    if hit is None or hit[0]() is not vocab_ids:
        weakref.finalize(vocab_ids, _TP_ROWS.pop, key, None)
    _TP_ROWS[key] = (weakref.ref(vocab_ids), weight, weight._version, rows, bias)
    return rows, bias


def _whole_copy(layer: nn.Module) -> nn.Module:
    """A copy of a decoder layer for an attention head. On a tensor-parallel model the copy gets whole (gathered)
    weights and loses the tensor-parallel forward wrappers, so the head runs alone on every rank (replicated);
    otherwise it is a plain deep copy. Collective on a tensor-parallel model (one gather per sharded weight)."""
    whole = {id(p): nn.Parameter(p.detach().full_tensor(), requires_grad=p.requires_grad)
             for p in layer.parameters() if is_dtensor(p)}
    if not whole:
        return copy.deepcopy(layer)
    out = copy.deepcopy(layer, memo=dict(whole))
    for module in out.modules():
        module.__dict__.pop("forward", None)  # transformers installs the sharded forward on the instance
        module.__dict__.pop("_is_hooked", None)
    return out
