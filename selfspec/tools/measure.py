"""Measuring, once for every tool: device synchronisation, timing, what machine and versions a number was taken
on, which model it was taken on, the model's EOS ids, and the rank correlation the calibrator reports.

The engine keeps its own sync (`decoding._sync`, for `settings.timed`); everything outside the engine that times
or describes a run takes it from here.
"""
from __future__ import annotations

import contextlib
import os
import platform
import time
from pathlib import Path

import torch


# --- timing ---------------------------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the device's queued work, so that a host clock read after it counts that work."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn, device=None, model=None):
    """(fn(), seconds), the device synchronised before and after the call when one is given. With the model, the
    seconds its compiled step spent compiling new pass shapes during the call are left out (compiled.py): a
    warm-up paid once, not a cost of decoding."""
    from ..compiled import warmup_seconds

    if device is not None:
        sync(device)
    compiling = warmup_seconds(model) if model is not None else 0.0
    t0 = time.perf_counter()
    out = fn()
    if device is not None:
        sync(device)
    seconds = time.perf_counter() - t0
    return out, seconds - (warmup_seconds(model) - compiling if model is not None else 0.0)


def fastest(fn, device, repeats: int = 5) -> float:
    """Fastest seconds of `fn()` over repeats after one warm-up call, synchronising the device around each call.
    The minimum, not the median: on a shared machine other processes only ever add time."""
    fn()
    return min(timed(fn, device)[1] for _ in range(repeats))


# --- where a number was measured ------------------------------------------------------------------------------
def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(device=None) -> dict:
    """CPU, cores (all and usable by this process), torch threads, the device's name, platform and Python."""
    device = torch.device("cpu" if device is None else device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "usable_cores": usable,
            "torch_threads": torch.get_num_threads(), "device": name, "platform": platform.platform(),
            "python": platform.python_version(), "machine": platform.machine()}


def versions(*packages: str) -> dict:
    """torch, transformers and selfspec versions, plus those of `packages` (e.g. "optuna")."""
    import importlib

    import transformers

    import selfspec

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "selfspec": selfspec.__version__}
    for name in packages:
        out[name] = getattr(importlib.import_module(name), "__version__", None)
    return out


def environment(device=None, packages: tuple = ()) -> dict:
    """machine_info and versions in one flat dict (what a stored study or a saved config records)."""
    return {**versions(*packages), **machine_info(device)}


def loadavg() -> list | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


# --- what it was measured on ----------------------------------------------------------------------------------
@torch.no_grad()
def model_identity(model, name: str | None = None) -> dict:
    """The model a measurement belongs to: its name, the identity saved heads are checked against (io.model_identity:
    type, sizes and an LM-head fingerprint that tells checkpoints of one shape apart), device type and dtype, and
    what makes its steps faster (step_speedups)."""
    from ..arch import adapter_for
    from ..io import model_identity as weights_identity, placement

    return {"model_name": name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
            **weights_identity(adapter_for(model)), **placement(model), **step_speedups(model)}


def step_speedups(model) -> dict:
    """What makes this model's steps faster than transformers' own, so that timings with and without it are
    another setup's: attention with grouped heads folded into rows (attention.py). Study identities and bench
    metadata record it."""
    from ..arch import adapter_for
    from ..attention import folds

    param = next(model.parameters())
    return {"folded_gqa": folds(adapter_for(model), param.device, param.dtype)}


def sampling_kwargs(temperature: float, top_p: float = 1.0) -> dict:
    """generate() arguments that sample at exactly these settings: nothing of the model's generation_config (its
    top_k, say) joins in. The bench and the calibrator time sampling with them."""
    return dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)


def eos_ids_of(model, tokenizer=None) -> list[int]:
    """The ids that end a generation: the generation config's (in its order), then the tokenizer's if it differs."""
    eos = model.generation_config.eos_token_id
    ids = [] if eos is None else [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]
    extra = None if tokenizer is None else tokenizer.eos_token_id
    if extra is not None and int(extra) not in ids:
        ids.append(int(extra))
    return list(dict.fromkeys(ids))


# --- statistics -----------------------------------------------------------------------------------------------
def average_ranks(values: list[float]) -> list[float]:
    """Ranks from 1, tied values sharing the mean of the ranks they span (what Spearman's rho is defined on)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation with ties (scipy's when installed), or None with fewer than 3 pairs or when
    either side is constant (no order to compare)."""
    if len(xs) != len(ys):
        raise ValueError(f"spearman needs pairs, got {len(xs)} and {len(ys)} values.")
    if len(xs) < 3 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    try:
        from scipy.stats import spearmanr
    except ImportError:
        return _pearson(average_ranks(xs), average_ranks(ys))
    return float(spearmanr(xs, ys).statistic)


def _pearson(a: list[float], b: list[float]) -> float | None:
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    var = (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5
    return cov / var if var else None
