"""Prepacked linear weights for bfloat16 on CPU: oneDNN's blocked weight layout made once, not at every call.

    selfspec.pack_weights(model)     # in place; the dense weights stay (state_dict, saving, training)
    selfspec.unpack_weights(model)

Packing is an opt-in (`pack_weights=True`, `--pack-weights`): it reaches oneDNN through private torch ops and
compiles a C++ kernel at run time. The compiled step (compiled.py, `compile=True`) prepacks the weights the
maintained way, through Inductor's freezing, within a few percent of this module's speed (docs/benchmarks.md).

A bfloat16 `nn.Linear` on CPU runs oneDNN's matmul, which reorders the whole weight into its blocked layout on
every call: at one token per call that reorder is about a third of the call. Measured on one core of an Intel
Xeon with AVX512-BF16: SmolLM2's 576 -> 1536 projection takes 165 us a call from the dense weight and 115 us
prepacked, a whole 1-token step 85 ms against 75 ms (python -m selfspec.tools.pass_cost). The
packed kernel gives the same bits as the dense call (checked per module when packing, below), so no output
changes.

Only bias-free bfloat16 `nn.Linear` modules with their weights on CPU are packed: with a bias the fused add
rounds differently, float32 goes through MKL (packing gives other bits and no speed), and quantized or offloaded
layers (bitsandbytes, accelerate hooks) compute their own way. The packed copy costs one more copy of those
weights in memory. A packed module falls back to the dense call whenever autograd records (training), the
input is not a CPU bfloat16 tensor, or its weight tensor was replaced or changed in place since packing.

On CPUs with AVX512-BF16, calls of at most 16 rows (decoding steps, drafts, verify passes) go to selfspec's own
kernel (small_gemm.py), fitted per weight to give oneDNN's bits: a 1-token step of SmolLM2 takes 58 ms instead of
80 here. Prefills stay with oneDNN's call.
"""
from __future__ import annotations

import contextlib
import functools
import types
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .small_gemm import KERNEL_REVISION, SMALL_ROWS, SmallWeight, fit, many_row_sums, small_linear

PROBE_ROWS = (1, 2, 5, 16)  # token counts the bit-identity probe tries: a decoding step, drafts, verify passes
_DENSE = [False]  # set by dense_weights(): packed modules compute from the dense weights
_ONEDNN = [False]  # set by onednn_weights(): packed modules leave the small-row kernel out


@dataclass
class Packed:
    """A weight's prepacked copies: oneDNN's, and for calls of at most small_gemm.SMALL_ROWS rows the small-row
    kernel's (None where it is unavailable or its bits would differ)."""

    onednn: torch.Tensor
    small: SmallWeight | None = None


class PackedForward:
    """A Linear's forward over its prepacked weight; set as the module's `forward` attribute."""

    def __init__(self, module: nn.Linear, packed: Packed):
        self.module = weakref.ref(module)  # no cycle module -> forward -> module
        self.packed = packed
        weight = module.weight
        self.stamp = _stamp(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module().weight
        return packed_linear(x, weight, self.packed if _stamp(weight) == self.stamp else None)

    def __deepcopy__(self, memo):
        # oneDNN's opaque tensor cannot be copied: the module's copy (made before its state) computes dense
        copy = memo.get(id(self.module()))
        return None if copy is None else types.MethodType(nn.Linear.forward, copy)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, packed: Packed | None) -> torch.Tensor:
    """x @ weight.T from `packed` (weight's packed copies, None when stale), or from the dense weight whenever
    autograd records (training) or x is not a CPU bfloat16 tensor. Calls of a few rows (a decoding step, a verify
    pass) take the small-row kernel where it was fitted, larger ones (a prefill) oneDNN's."""
    if packed is None or _DENSE[0] or torch.is_grad_enabled() or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return nn.functional.linear(x, weight)
    if packed.small is not None and not _ONEDNN[0] and x.numel() <= SMALL_ROWS * x.shape[-1]:
        return small_linear(x, packed.small)
    return _onednn_linear(x.contiguous(), packed.onednn)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@contextlib.contextmanager
def dense_weights():
    """Packed modules compute from their dense weights inside this block: a side-by-side baseline (the bench's
    hf-greedy-dense) without unpacking and packing again."""
    before, _DENSE[0] = _DENSE[0], True
    try:
        yield
    finally:
        _DENSE[0] = before


@contextlib.contextmanager
def onednn_weights():
    """Packed modules compute with oneDNN's call alone inside this block (the bench's hf-greedy-onednn: what the
    small-row kernel gains, side by side)."""
    before, _ONEDNN[0] = _ONEDNN[0], True
    try:
        yield
    finally:
        _ONEDNN[0] = before


@contextlib.contextmanager
def unpacked(model: nn.Module):
    """The model unpacked inside this block, packed again as it was after it (a method that runs from the dense
    modules themselves, such as the compiled step, beside packed ones in one benchmark)."""
    packed, small = is_packed(model), packs_small(model)
    if packed:
        unpack_weights(model)
    try:
        yield
    finally:
        if packed:
            pack_weights(model, small_gemm=bool(small))


def computing_with(weights: str):
    """The context for a baseline's weights: "packed" (as packed, nothing changed), "dense" or "onednn"."""
    return {"packed": contextlib.nullcontext, "dense": dense_weights, "onednn": onednn_weights}[weights]()


def _stamp(weight: torch.Tensor) -> tuple:
    """What identifies the weight the packed copy was made from: a new tensor or an in-place change differs."""
    return weight.data_ptr(), weight._version, weight.dtype, weight.device


def packing_available() -> bool:
    """Whether bfloat16 weights can be packed here: see packing_unavailable_reason."""
    return packing_unavailable_reason() is None


@functools.lru_cache(maxsize=None)
def packing_unavailable_reason() -> str | None:
    """Why oneDNN's packed bfloat16 linear cannot run in this process, or None where it can. Two things can stop
    it: a torch build without mkldnn, and a CPU that oneDNN refuses for packed bf16 weights (it wants AVX512BW,
    VL and DQ, or AVX-NE-CONVERT; an AMD EPYC of the Zen 3 generation has AVX2 only). Only a call tells the
    second, so a tiny weight is packed once per process."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build lacks oneDNN (mkldnn); use a CPU build of torch with mkldnn"
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), None)
        torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError) as err:
        found = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        return f"oneDNN cannot pack bfloat16 weights on this CPU or build ({found})"
    return None


def packable(module: nn.Module) -> bool:
    """A plain bias-free bfloat16 nn.Linear whose weight is on CPU and no accelerate hook moves."""
    if type(module) is not nn.Linear or module.bias is not None or hasattr(module, "_hf_hook"):
        return False
    weight = module.weight
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu"


@torch.no_grad()
def pack_matrix(weight: torch.Tensor, small: bool = True) -> Packed | None:
    """The packed copies of a bfloat16 CPU weight (out, in), or None when oneDNN's packed kernel's output differs
    from the dense call's by a single bit on random inputs of PROBE_ROWS rows (packing must not change outputs).
    With `small`, the small-row kernel is fitted too, against that packed call (small_gemm.fit)."""
    weight = weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    generator = torch.Generator().manual_seed(0)
    for rows in PROBE_ROWS:
        x = torch.randn(1, rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        if not torch.equal(_onednn_linear(x, packed), nn.functional.linear(x, weight)):
            return None
    return Packed(packed, fit(weight, lambda x: _onednn_linear(x, packed)) if small else None)


@torch.no_grad()
def pack_linears(root: nn.Module, small: bool = True) -> tuple[int, int]:
    """Pack every packable Linear under `root` (already packed ones are kept): (packed now, refused by the probe)."""
    done, refused = 0, 0
    for module in root.modules():
        if not packable(module) or is_packed_module(module):
            continue
        packed = pack_matrix(module.weight, small)
        if packed is None:
            refused += 1
            continue
        module.forward = PackedForward(module, packed)
        done += 1
    return done, refused


def is_packed_module(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), PackedForward)


def is_packed(root: nn.Module) -> bool:
    return any(is_packed_module(m) for m in root.modules())


def packs_small(root: nn.Module) -> bool:
    """Whether some packed Linear under `root` runs the small-row kernel for small calls."""
    return any(is_packed_module(m) and m.forward.packed.small is not None for m in root.modules())


def small_kernel_revision(root: nn.Module) -> str | bool:
    """The small-row kernel's revision (small_gemm.KERNEL_REVISION) and its sums of many rows, as "3-dot", where
    `root` runs it, else False: what study identities and bench metadata record, since each steps at another
    speed."""
    return f"{KERNEL_REVISION}-{many_row_sums()}" if packs_small(root) else False


def apply_choice(model: nn.Module, choice: bool | None) -> None:
    """The pack_weights option of selfspec.load, bench and calibrate: True packs (and refuses a model with nothing
    to pack); None and False leave the model dense."""
    if choice:
        pack_weights(model)


def pack_weights(model: nn.Module, small_gemm: bool = True) -> int:
    """Prepack the model's bias-free bfloat16 Linear weights on CPU, in place; returns how many were packed.
    Heads that a wrapped model adds afterwards are packed with it. Refuses a model with nothing to pack.
    `small_gemm=False` keeps oneDNN's call for calls of every size (a side-by-side measure of the kernel)."""
    reason = packing_unavailable_reason()
    if reason is not None:
        raise ValueError(f"pack_weights cannot run here: {reason}. Run without packing (pack_weights=False, "
                         f"--no-pack-weights): the tokens are the same, the steps slower.")
    done, refused = pack_linears(model, small_gemm)
    if refused:
        import warnings

        warnings.warn(f"pack_weights: left {refused} Linear module(s) unpacked: oneDNN's packed kernel gave other "
                      f"bits than the dense call on this machine, and packing must not change outputs.", stacklevel=2)
    if done == 0 and not is_packed(model):
        weight = next((p for p in model.parameters()), None)
        found = "no parameters" if weight is None else f"{weight.dtype} on {weight.device}"
        found += ", all refused by the probe" if refused else ""
        raise ValueError(f"pack_weights found nothing to pack ({found}): it packs bias-free bfloat16 nn.Linear "
                         f"weights on CPU. Load the model with dtype=torch.bfloat16 on CPU, or leave it unpacked.")
    for head in _heads_of(model):
        pack_linears(head, small_gemm)
    return done


def _heads_of(model: nn.Module) -> list[nn.Module]:
    """The exit heads of a wrapped model (kept by its engine, not submodules of the model); none otherwise."""
    engine = getattr(model, "selfspec", None)
    return list(engine.heads.values()) if engine is not None else []


def unpack_weights(root: nn.Module) -> int:
    """Drop the packed copies under `root` (model or head); its Linears compute from the dense weights again."""
    count = 0
    for module in root.modules():
        if is_packed_module(module):
            del module.forward
            count += 1
    return count + sum(unpack_weights(head) for head in _heads_of(root))
