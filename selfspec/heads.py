"""Exit heads: map layer-E hidden states (B, T, H) to draft logits (B, T, V_draft).

A head may score only a subset of the vocabulary (`vocab_ids`, (V_draft,) ids into the full vocabulary);
the engine then drafts only tokens of that subset, with q = 0 elsewhere, which keeps verification exact.
Heads share the model's final norm and LM head through the adapter and never register them as their own
parameters, so saving a head writes only what it adds.
"""
from __future__ import annotations

import torch
from torch import nn

from .arch.base import ArchAdapter
from .draft_logits import lm_logits, token_logits
from .tp_weights import whole_copy


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


def copied_layer(adapter: ArchAdapter, exit_layer: int, source_layer: int | None, what: str):
    """(a trainable copy of the model's decoder layer `source_layer` (default: the exit layer, which already reads
    states of that depth), its index): the layer of a head with a cache of its own."""
    source = exit_layer if source_layer is None else source_layer
    if not 0 <= source < adapter.num_layers:
        raise ValueError(f"source_layer {source} outside [0, {adapter.num_layers - 1}].")
    layer = adapter.layers[source]
    if any(not p.is_floating_point() or p.device.type == "meta" for p in layer.parameters()):
        raise ValueError(
            f"{what} copies decoder layer {source}, but its weights are quantized or offloaded. "
            "Build and train heads on the unquantized model, then load them into the quantized one.")
    return whole_copy(layer).requires_grad_(True), source


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
        layer, source = copied_layer(adapter, exit_layer, source_layer, "An attention head")
        return cls(exit_layer, layer, source, context, vocab_ids)

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
        """`teacher_forced_states`' (B, T, V_draft) draft logits."""
        return self.logits(self.teacher_forced_states(early, top, adapter, lengths, round_len, offset), adapter)

    def teacher_forced_states(self, early, top, adapter: ArchAdapter, lengths=None, round_len: int = 1,
                              offset: int = 0) -> torch.Tensor:
        """The layer's (B, T, H) outputs at every position of right-padded sequences, each seeing the context it
        would see while drafting (training and the calibrator's acceptance profile; `logits` of them are drafts).

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
            return self.attend(early, adapter, j.expand(b, t), (mask | torch.eye(t, dtype=torch.bool,
                                                                                   device=device))[:, None])
        # keys: [top_0 .. top_T-1, early_0 .. early_T-1]; only the early half's queries are used
        _, mask, positions = round_mask(valid, round_len, offset)
        return self.attend(torch.cat([top, early], dim=1), adapter, positions, mask)[:, t:]


def layer_pass(adapter: ArchAdapter, head: "AttentionHead", positions, mask, cache, hidden) -> torch.Tensor:
    """An attention head's pass over its own cache (Runner.run_own): its layer on (B, T, H) states -> (B, T, H)."""
    return head.attend(hidden, adapter, positions, mask, cache)


def fused_pass(adapter: ArchAdapter, head: "FusedHead", positions, mask, cache, hidden, prev) -> torch.Tensor:
    """A fused head's pass over its own cache (Runner.run_own): (B, T, H) layer-E states and the final states before
    them (the verifier's, or the head's own estimates) -> the head's (B, T, H) normed outputs; the fused states' KV
    goes to the cache. One function for drafting and for feeding verified positions, so both compile."""
    return head.normed_out(head.attend(head.fused(hidden, adapter, prev), adapter, positions, mask, cache), adapter)


def round_mask(valid: torch.Tensor, round_len: int, offset: int):
    """Draft rounds of `round_len` starting at `offset`, over right-padded sequences whose real keys `valid` (B, T)
    marks: (start (T,), the first position of each query's round; mask (B, 1, 2T, 2T) over keys laid out as
    [verified 0 .. T-1, drafted 0 .. T-1], where a drafted query j sees the verified keys before its round and the
    drafted ones from its round's start to j (a verified query sees only itself; its output is thrown away);
    positions (B, 2T))."""
    b, t = valid.shape
    j = torch.arange(t, device=valid.device)
    start = j - torch.remainder(j - offset, round_len)
    mask = torch.zeros(b, 2 * t, 2 * t, dtype=torch.bool, device=valid.device)
    mask[:, t:, :t] = (j[None, :] < start[:, None])[None] & valid[:, None, :]
    mask[:, t:, t:] = ((j[None, :] >= start[:, None]) & (j[None, :] <= j[:, None]))[None] & valid[:, None, :]
    mask |= torch.eye(2 * t, dtype=torch.bool, device=valid.device)
    return start, mask[:, None], torch.cat([j, j]).expand(b, 2 * t)


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


@register_head
class FusedHead(ExitHead):
    """EAGLE's draft model at the exit: a top-reading MLP head fuses each token's layer-E state with the final state
    of the position before it, then one decoder layer of the head's own attends over the fused states of the text
    so far, through a KV cache of its own (HeadCache) whose slots mirror the shared cache.

    With `copy_max` > 0 it is also a copy head, as MLPHead is (its MLP holds the trust in the candidate).

    Verified positions enter that cache fused with the verifier's final states; a draft enters fused with the
    head's own estimate of the state before it (its normed output there), so each draft conditions on the drafts
    before it in feature space, and after verification the accepted ones are fed again with the true states.
    The layer's change enters the residual scaled by `mix` (H,), zero at first: a fused head built from a trained
    MLP head (`from_mlp`) drafts exactly as that head does until training moves `mix`. Drafts are verified by the
    full model, so the output stays exact whatever the head learned.
    """

    kind = "fused"
    stateful = True
    reads_top = True

    def __init__(self, exit_layer: int, hidden_size: int, layer: nn.Module, source_layer: int,
                 rank: int | None = None, vocab_ids: torch.Tensor | None = None, eps: float = 1e-6,
                 copy_max: int = 0):
        super().__init__(exit_layer, vocab_ids)
        self.hidden_size, self.source_layer = hidden_size, source_layer
        # the fusion, and with copy_max > 0 the trust in prompt lookup's candidate (MLPHead's); its vocab is unused
        self.mlp = MLPHead(exit_layer, hidden_size, rank, None, eps, context="top", copy_max=copy_max)
        self.rank, self.copy_max = self.mlp.rank, copy_max
        self.layer = layer
        for module in self.layer.modules():  # its KV goes to layer 0 of the head's own cache
            if hasattr(module, "layer_idx"):
                module.layer_idx = 0
        self.mix = nn.Parameter(torch.zeros(hidden_size))

    @classmethod
    def from_model(cls, adapter: ArchAdapter, exit_layer: int, source_layer: int | None = None,
                   rank: int | None = None, vocab_ids: torch.Tensor | None = None, copy_max: int = 0) -> "FusedHead":
        """A fused head whose layer starts as a copy of the model's layer `source_layer` (default: layer E itself,
        which already reads states of this depth) and whose MLP starts as the plain exit."""
        layer, source = copied_layer(adapter, exit_layer, source_layer, "A fused head")
        param = next(layer.parameters())
        head = cls(exit_layer, adapter.hidden_size, layer, source, rank, vocab_ids, copy_max=copy_max)
        return head.to(param.device, param.dtype)

    def with_copy(self, copy_max: int, vocab_ids: torch.Tensor | None = None) -> "FusedHead":
        """This head (weights copied) that also scores prompt lookup's candidate, its trust at zero, over
        `vocab_ids` when given (else its own draft vocabulary): what train.train_copy fits."""
        weight = self.mix
        new = type(self)(self.exit_layer, self.hidden_size, whole_copy(self.layer), self.source_layer, self.rank,
                         self.vocab_ids if vocab_ids is None else vocab_ids, copy_max=copy_max)
        new.load_state_dict({k: v for k, v in self.state_dict().items() if k != "vocab_ids" and ".copy_" not in k},
                            strict=False)
        return new.to(weight.device, weight.dtype)

    @property
    def copy_bias(self) -> nn.Parameter:
        return self.mlp.copy_bias

    @property
    def copy_gate(self) -> nn.Linear:
        return self.mlp.copy_gate

    def copy_score(self, own, normed, match):
        """MLPHead.copy_score: the candidate's logit from its own, its match length and the head's normed state."""
        return self.mlp.copy_score(own, normed, match)

    def copy_logit(self, normed, adapter: ArchAdapter, token, match):
        return self.mlp.copy_logit(normed, adapter, token, match)

    @classmethod
    def from_mlp(cls, mlp: MLPHead, adapter: ArchAdapter, source_layer: int | None = None) -> "FusedHead":
        """A fused head that starts as the trained top-reading MLP head `mlp` (same exit, width and draft
        vocabulary; a copy head's trust in its candidate is not carried)."""
        if not (isinstance(mlp, MLPHead) and mlp.reads_top):
            raise ValueError(f"A fused head starts from an `mlp` head with context top; got "
                             f"{getattr(mlp, 'kind', type(mlp).__name__)!r} with context "
                             f"{getattr(mlp, 'context', None)!r}. Train one with --head mlp --context top.")
        head = cls.from_model(adapter, mlp.exit_layer, source_layer, mlp.rank, mlp.vocab_ids)
        weight = mlp.up.weight
        head.mlp.load_state_dict({k: v for k, v in mlp.state_dict().items() if not k.startswith("copy_")
                                  and k != "vocab_ids"}, strict=False)
        return head.to(weight.device, weight.dtype)

    @classmethod
    def from_spec(cls, spec: dict, adapter: ArchAdapter) -> "FusedHead":
        if spec["hidden_size"] != adapter.hidden_size:
            raise ValueError(f"Fused head for hidden size {spec['hidden_size']}, model has {adapter.hidden_size}.")
        return cls.from_model(adapter, spec["exit_layer"], spec["source_layer"], spec["rank"], _vocab_placeholder(spec),
                              spec.get("copy_max", 0))

    def spec(self) -> dict:
        return {**super().spec(), "hidden_size": self.hidden_size, "rank": self.rank,
                "source_layer": self.source_layer, **({"copy_max": self.copy_max} if self.copy_max else {})}

    def fused(self, hidden: torch.Tensor, adapter: ArchAdapter, prev_top: torch.Tensor) -> torch.Tensor:
        """(B, T, H) layer-E states and the final states before them -> the (B, T, H) inputs of the head's layer."""
        return self.mlp.transform(hidden, adapter, prev_top)

    def attend(self, fused: torch.Tensor, adapter: ArchAdapter, positions, mask=None, cache=None) -> torch.Tensor:
        """The head's layer on (B, T, H) fused states at (B, T) positions, its change scaled by `mix`; with a
        cache, appends to its layer 0."""
        out = adapter.call_module(self.layer, self.source_layer, fused, mask, positions,
                                  adapter.rotary(fused, positions), cache)
        return fused + self.mix.to(fused.dtype) * (out - fused)

    def normed(self, hidden: torch.Tensor, adapter: ArchAdapter, prev_top=None) -> torch.Tensor:
        """Stateless: the (B, T, H) normed outputs of (B, T, H) states attending causally over these T positions
        only, with no earlier context (what one draft computes, for the cost model's timing); the drafter runs the
        head through its cache (head_state.HeadCache.feed)."""
        if prev_top is None:
            raise ValueError("A fused head reads the previous position's final state: pass prev_top.")
        b, t = hidden.shape[:2]
        positions = torch.arange(t, device=hidden.device).expand(b, t)
        mask = torch.ones(t, t, dtype=torch.bool, device=hidden.device).tril()[None, None].expand(b, 1, t, t)
        return self.normed_out(self.attend(self.fused(hidden, adapter, prev_top), adapter, positions, mask), adapter)

    def normed_out(self, out: torch.Tensor, adapter: ArchAdapter) -> torch.Tensor:
        """The head's estimate of the final-normed state there: what the LM head scores and the next draft reads."""
        return adapter.final_norm(out)

    def logits(self, out: torch.Tensor, adapter: ArchAdapter) -> torch.Tensor:
        return lm_logits(adapter, self.normed_out(out, adapter), self.vocab_ids)

    def forward(self, hidden, adapter: ArchAdapter, prev_top=None) -> torch.Tensor:
        """Stateless use: (B, T, H) layer-E states and the true final states before them -> (B, T, V_draft) logits
        of every position's first draft (`normed`)."""
        return lm_logits(adapter, self.normed(hidden, adapter, prev_top), self.vocab_ids)

    def teacher_forced_states(self, early, top, adapter: ArchAdapter, lengths=None, round_len: int = 1,
                              offset: int = 0) -> torch.Tensor:
        """The head's (B, T, H) layer outputs at every position of right-padded sequences, each as the decode
        loop makes it (training and evaluation; `logits` of them are the drafts).

        early, top: (B, T, H) layer-E and final-normed states; lengths (B,) valid lengths. Positions are drafted
        in rounds of `round_len` starting at `offset`: a round's first draft reads the true final state before it,
        each later one the head's estimate; its query sees the verified positions fused with true states and the
        round's earlier drafts fused as they were drafted. A round of R drafts takes R passes of the layer (the
        first pass gives every round's first draft, pass m its m-th), as EAGLE-3's training-time test does: the
        first is causal over the T positions, each later one runs over 2T (verified and drafted) keys."""
        b, t = early.shape[:2]
        device = early.device
        lengths = torch.full((b,), t, device=device) if lengths is None else lengths.to(device)
        j = torch.arange(t, device=device)
        valid = j[None, :] < lengths[:, None]  # (B, T) real keys
        true_fused = self.fused(early, adapter, previous_top(top))
        if round_len == 1:
            mask = ((j[None, :] <= j[:, None])[None] & valid[:, None, :]) | torch.eye(t, dtype=torch.bool,
                                                                                         device=device)
            return self.attend(true_fused, adapter, j.expand(b, t), mask[:, None])
        # keys: [verified (true) 0 .. T-1, drafted 0 .. T-1]; only the drafted half's queries are used
        start, mask, positions = round_mask(valid, round_len, offset)
        first = (j == start) | (j == 0)  # rounds' first drafts (and the text's first position) read true states
        prev = previous_top(top)
        # the first pass drafts every round's first token: its drafted keys are the true ones, so it is causal
        out = self.teacher_forced_states(early, top, adapter, lengths)
        for _ in range(1, round_len):  # pass m settles every round's m-th draft; later passes leave it as it is
            drafted = self.fused(early, adapter, torch.where(first[None, :, None], prev,
                                                             previous_top(self.normed_out(out, adapter))))
            out = self.attend(torch.cat([true_fused, drafted], dim=1), adapter, positions, mask)[:, t:]
        return out

    def teacher_forced(self, early, top, adapter: ArchAdapter, lengths=None, round_len: int = 1,
                       offset: int = 0) -> torch.Tensor:
        """`teacher_forced_states`' (B, T, V_draft) draft logits."""
        return self.logits(self.teacher_forced_states(early, top, adapter, lengths, round_len, offset), adapter)
