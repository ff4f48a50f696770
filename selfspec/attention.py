"""The engine's attention: grouped-query attention folded into query rows for bfloat16 passes on a CPU, and grouped
KV heads attended in place under a mask.

`wrap` points the model at ENGINE_ATTENTION once (`set_attn_implementation`, undone by `unwrap`); the engine's own
decoder-layer calls carry ENGINE_CALL=True in their keyword arguments (arch adapters), which transformers hands on
to the attention function. Every other call (the model's own forward, training) goes to transformers' sdpa as it
would without selfspec, so nothing is switched per forward: no environment variable, no config attribute.

Why fold: torch's CPU flash attention computes each (batch, head) pair on its own, with small gemms whose fixed cost
dominates at decoding sizes, and a 1-token query takes a path slower still (on one AMD EPYC core a 1-token call over
600 cached tokens costs 735 us, a 2-token call 294 us). With grouped KV heads (SmolLM2: 9 query heads over 3 KV
heads) the G query heads that share a KV head can instead be G x T rows of one query against that KV head: q (B, Hq,
T, D) viewed as (B, Hkv, G * T, D), the mask repeated over the G groups. Same keys, same values, a third of the
calls, never a 1-row call: 131 us for the 1-token call, 155 us for the 2-token one. The fold is plain reshapes, so
the compiled step (compiled.py) traces it too.

Why in place: with a mask, transformers copies the KV of every layer to all query heads (repeat_kv), which is every
verify pass and tree; torch's CPU kernel attends grouped heads itself (`enable_gqa`) with the same bits
(tests/test_forward.py). Not on CUDA, where a masked grouped call falls back to the math kernel.

Bits: the fold is the same attention, exactly, but its sums run in other gemm calls (G * T rows instead of T), and
torch's bf16 gemms round by row count: outputs move in the last bits, as a multi-token pass's already do against
a 1-token one. float32 therefore never folds (the regime where the engine's outputs are token-identical to plain
`generate`); in bf16, outputs may part from plain `generate` at near-ties, as every verifier's do, and `selfspec
bench` judges each such parting (tools/verdict.py). tests/test_attention.py checks the folded call against float64
attention, no further from it than torch's own call. SELFSPEC_FOLDED_GQA=0 turns the fold off (read when a call
is traced or run, for side-by-side timing). Nothing folds on CUDA, without grouped heads, for the causal flag of an
unpadded prefill (no mask: rows must stay positions), above 32 rows (torch's CPU query block), or with
softcapping, position biases or attention sinks: those calls go to transformers' own sdpa function.
"""
from __future__ import annotations

import os

import torch
from torch.nn import functional as F

ENGINE_ATTENTION = "selfspec_sdpa"  # the name registered with transformers' AttentionInterface
ENGINE_CALL = "selfspec_engine"  # keyword the engine's layer calls carry through to the attention function
SWITCH = "SELFSPEC_FOLDED_GQA"  # set to 0: no call folds
# torch's CPU query block for short queries: longer calls split into blocks of 32 rows, where a last block of one
# row would take the slow 1-row path; passes that long (padded prefills) are not what the fold is for
MAX_ROWS = 32
_FOLD_DTYPES = (torch.bfloat16,)  # measured here; float32 is the exact regime and gains nothing (module docstring)
_UNFOLDABLE_KWARGS = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


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
    if os.environ.get(SWITCH, "1") == "0" or _plain_only(kwargs):
        return False
    if mask is not None and mask.shape[1] != 1:  # a per-head mask cannot be shared by the folded groups
        return False
    return t == 1 or mask is not None  # no mask over several tokens: the causal prefill, whose rows are positions


def _plain_only(kwargs: dict) -> bool:
    return any(kwargs.get(name) not in (None, False) for name in _UNFOLDABLE_KWARGS)


def engine_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                **kwargs):
    """transformers' attention-function signature: (B, Hq, T, D) query, (B, Hkv, L, D) key and value ->
    ((B, T, Hq, D) output, None). The engine's calls fold or attend grouped heads in place (module docstring);
    anything else is transformers' sdpa function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    engine = kwargs.pop(ENGINE_CALL, False)
    groups = getattr(module, "num_key_value_groups", 1)
    if engine and not module.training and groups > 1:
        if can_fold(query, attention_mask, groups, kwargs):
            rows, mask = fold_rows(query, attention_mask, groups)
            out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)  # (B, Hkv, G*T, D)
            return out.view(query.shape).transpose(1, 2).contiguous(), None
        if attention_mask is not None and query.device.type == "cpu" and not _plain_only(kwargs):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                 enable_gqa=True)
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def folds(adapter, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine folds this model's attention (calls it cannot fold still go to transformers'): the engine's
    attention with grouped KV heads, bf16 on a CPU, and SELFSPEC_FOLDED_GQA not 0. Measurement identities record it."""
    return (os.environ.get(SWITCH, "1") != "0" and adapter.attn_impl == "sdpa" and device.type == "cpu"
            and dtype in _FOLD_DTYPES and _grouped(adapter.config) and uses_engine_attention(adapter.model))


def uses_engine_attention(model) -> bool:
    return getattr(model.config, "_attn_implementation", None) == ENGINE_ATTENTION


def use_engine_attention(model) -> None:
    """Point a model that attends with sdpa at the engine's attention (wrap); other implementations stay as they
    are (eager attention is the reference, and keeps its own path)."""
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        _register()
        model.set_attn_implementation(ENGINE_ATTENTION)


def restore_attention(model) -> None:
    """Undo use_engine_attention (unwrap)."""
    if uses_engine_attention(model):
        model.set_attn_implementation("sdpa")


def _grouped(config) -> bool:
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return bool(heads) and kv_heads < heads


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(ENGINE_ATTENTION, engine_sdpa)
        AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)  # the model's own forward builds sdpa's masks
        _registered = True
