"""Grouped-query attention folded into query rows, for bfloat16 passes on a CPU.

    with folded_gqa(adapter, hidden):   # around the engine's own decoder-layer calls (forward.run_layers)
        hidden = adapter.call_layer(...)

Why: torch's CPU flash attention computes each (batch, head) pair on its own, with small gemms whose fixed cost
dominates at decoding sizes, and a 1-token query takes a path slower still (on one AMD EPYC core a 1-token
call over 600 cached tokens costs 735 us, a 2-token call 294 us). With grouped KV heads (SmolLM2: 9 query heads
over 3 KV heads) the G query heads that share a KV head can instead be G x T rows of one query against that KV
head: q (B, Hq, T, D) viewed as (B, Hkv, G * T, D), the mask repeated over the G groups. Same keys, same values,
a third of the calls, never a 1-row call: 131 us for the 1-token call, 155 us for the 2-token one, and a whole
1-token pass of SmolLM2 over 600 cached tokens in 44.2 ms against 62.6 ms (one thread, median of 25 calls).

Bits: the fold is the same attention, exactly, but its sums run in other gemm calls (G * T rows instead of T), and
torch's bf16 gemms round by row count: outputs move in the last bits, as a multi-token pass's already do against
a 1-token one. float32 therefore never folds (the regime where the engine's outputs are token-identical to plain
`generate`, and a float32 fold saves nothing here); in bf16, outputs may part from plain `generate` at near-ties,
as every verifier's do, and `selfspec bench` judges each such parting (tools/verdict.py). tests/test_attention.py
checks the folded call against float64 attention, no further from it than torch's own call. SELFSPEC_FOLDED_GQA=0
turns it off. Nothing folds on CUDA (whose kernels take grouped heads natively), without grouped heads, for the
causal flag of an unpadded prefill (no mask: rows must stay positions), above 32 rows (torch's CPU query block),
or with softcapping, position biases or attention sinks: those calls go to transformers' own sdpa function.

The fold reaches a model's attention through transformers' AttentionInterface: FOLDED is registered once, and
`folded_gqa` points the model's config at it for the duration of the engine's call only, so the model's own forward
and generate never see it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os

import torch
from torch.nn import functional as F

FOLDED = "selfspec_folded_sdpa"  # the name registered with transformers' AttentionInterface
SWITCH = "SELFSPEC_FOLDED_GQA"  # set to 0: no call folds (read at every engine forward, for side-by-side timing)
# torch's CPU query block for short queries: longer calls split into blocks of 32 rows, where a last block of one
# row would take the slow 1-row path; passes that long (padded prefills) are not what the fold is for
MAX_ROWS = 32
_FOLD_DTYPES = (torch.bfloat16,)  # measured here; float32 is the exact regime and gains nothing (module docstring)
_UNFOLDABLE_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")
# set inside folded_gqa: a call from elsewhere (another thread using the model meanwhile) is left to transformers
_engine_call = contextvars.ContextVar("selfspec_folded_gqa", default=False)


def fold_rows(query: torch.Tensor, mask: torch.Tensor | None, groups: int):
    """(B, Hq, T, D) queries and a (Bm, 1, T, L) mask -> (B, Hq / G, G * T, D) rows and a (Bm, 1, G * T, L)
    mask: query head h = kv * G + g (transformers' repeat_kv order) becomes rows [g * T, (g + 1) * T) of KV head kv."""
    b, hq, t, d = query.shape
    rows = query.reshape(b, hq // groups, groups * t, d)
    if mask is not None:
        bm, length = mask.shape[0], mask.shape[-1]
        mask = mask[:, :, None].expand(bm, 1, groups, t, length).reshape(bm, 1, groups * t, length)
    return rows, mask


def can_fold(query: torch.Tensor, mask: torch.Tensor | None, groups: int, kwargs: dict) -> bool:
    """Whether a (B, Hq, T, D) query call with this mask folds (module docstring)."""
    t = query.shape[2]
    if groups <= 1 or query.device.type != "cpu" or query.dtype not in _FOLD_DTYPES or groups * t > MAX_ROWS:
        return False
    if any(kwargs.get(name) is not None for name in _UNFOLDABLE_KWARGS):
        return False
    if mask is not None and mask.shape[1] != 1:  # a per-head mask cannot be shared by the folded groups
        return False
    return t == 1 or mask is not None  # no mask over several tokens: the causal prefill, whose rows are positions


def folded_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                **kwargs):
    """transformers' attention-function signature: (B, Hq, T, D) query, (B, Hkv, L, D) key and value ->
    ((B, T, Hq, D) output, None). Folds where `can_fold` says so, else transformers' sdpa function decides."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if not _engine_call.get() or module.training or not can_fold(query, attention_mask, groups, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    rows, mask = fold_rows(query, attention_mask, groups)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)  # (B, Hkv, G * T, D)
    return out.view(query.shape).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def folded_gqa(adapter, hidden: torch.Tensor):
    """Route the model's sdpa attention through `folded_sdpa` while in scope, for a CPU bf16 model with grouped KV
    heads; anything else is left as it is."""
    config = adapter.config
    if not folds(adapter, hidden.device, hidden.dtype) or getattr(config, "_attn_implementation", None) != "sdpa":
        yield  # another implementation, or a scope already open (the config points at FOLDED)
        return
    _register()
    token = _engine_call.set(True)
    config._attn_implementation = FOLDED
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
        _engine_call.reset(token)


def folds(adapter, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine folds this model's attention (calls it cannot fold still go to transformers'): sdpa with
    grouped KV heads, bf16 on a CPU, and SELFSPEC_FOLDED_GQA not 0. Measurement identities record it."""
    return (os.environ.get(SWITCH, "1") != "0" and adapter.attn_impl == "sdpa" and device.type == "cpu"
            and dtype in _FOLD_DTYPES and _grouped(adapter.config))


def _grouped(config) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads) and kv_heads < heads


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(FOLDED, folded_sdpa)
        _registered = True
