"""The static-shape step: the engine's passes after the prompt run through torch.compile.

    selfspec.wrap(model, compile=True)      # or SelfSpecConfig(compile=True), or --compile on the command line

Every pass the engine makes once the prompt is in (a drafted token through layers [0, E), a verify pass through
[E, L), a tree, the LM head over a verify pass) runs a compiled function of a few fixed shapes. The layer pass is
the runner's own `layer_range` (runner.py), compiled over the cache's buffers; this module keeps the graphs:

- the T query tokens are padded up to a bucket: powers of two (BUCKETS), and the sizes of a call's full verify
  passes (K + 1, a copying chain's and a tree's), which are the most frequent and would otherwise run up to
  half again as many rows as they need; a padding row attends its own slot only, and writes its KV
  to a slot past the live ones, where nothing reads it before a real token overwrites it;
- the KV cache is the preallocated, zeroed buffer of each layer (cache.SpecLayer), written at slot indices given as a
  tensor (index_copy_) and read up to the pass's last slot. On a CPU that length is the one dimension marked dynamic,
  so a growing sequence never recompiles; on CUDA the whole buffer is read (static, as CUDA graphs need it), and the
  buffer's size is rounded up to a power of two;
- positions, masks and slot indices are tensors.

So each (layer range, bucket, batch) compiles once, and nothing recompiles after the warm-up (tests/test_compiled.py
counts). On a CPU, Inductor's freezing folds the weights in as constants and prepacks them into oneDNN's blocked
layout once, instead of the reorder an eager bfloat16 Linear makes at every call. Each graph keeps its own copy, so
where the copies of every bucket would not fit in the memory available (COPIES_PER_STATIC_STEP), every pass of a
layer range shares one graph, its token count marked dynamic and a single token padded to two rows. On CUDA,
mode="reduce-overhead" captures CUDA graphs, which removes the per-kernel launch cost that bounds an eager step of a
small model. An exit head's MLP and the LM-head rows of its draft vocabulary compile the same way, and so does a
stateful head's own pass (its layer over a one-layer cache of its own, Runner.run_own), at the same buckets. The
prompt, whose length changes from call to call, runs eager.

The compiled graphs hold the weights as they were when compiled (freezing folds them in as constants): a model
whose weights change afterwards gets `model.selfspec.reset_compiled()`.
"""
from __future__ import annotations

import contextlib
import shutil
import time
import warnings
import weakref

import torch

BUCKETS = (1, 2, 4, 8, 16, 32)  # query tokens per compiled pass, padded up to the next
MAX_GRAPHS = 64  # compiled graphs per function (layer ranges x buckets x batch sizes x head shapes)


def bucket(tokens: int, buckets=BUCKETS) -> int | None:
    """The compiled pass size a pass of `tokens` tokens runs at, or None (eager) past the largest."""
    return next((b for b in buckets if b >= tokens), None)


def compiler_missing(device: torch.device) -> str | None:
    """Why torch.compile cannot run on this device, or None. Inductor writes C++ for a CPU and needs a compiler."""
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return "no C++ compiler (g++ or clang++) is on PATH for torch.compile's CPU code"
    if device.type not in ("cpu", "cuda"):
        return f"the compiled step supports CPU and CUDA, not {device.type}"
    return None


def head_logits(adapter, normed):
    """The LM head on (B, Tb, H) final-normed states -> (B, Tb, V) (ArchAdapter.logits caps them where needed)."""
    return adapter.lm_head(normed)


def exit_head_output(head, adapter, hidden, prev_top):
    """An exit head's (B, Tb, H) final-normed output from (B, Tb, H) layer-E states, and for a top-reading head the
    (B, Tb, H) final states it reads (None for the others)."""
    return head.normed_eager(hidden, adapter, prev_top)


def row_logits(rows: torch.nn.Linear, normed):
    """(B, Tb, H) normed states -> (B, Tb, V_draft) logits of a head's draft vocabulary: the LM head's rows as a
    module of their own, so that freezing folds them in (and prepacks them) as it does the model's weights."""
    return rows(normed)


# (device type, function) -> its compiled version: one each, whatever the model, so that Dynamo's graphs (kept per
# function) serve every engine; the graphs themselves are per model and per head (guards)
_FUNCTIONS: dict[tuple, object] = {}
# model -> {device: its CompiledStep}: the steps outlive a wrap, as the graphs do
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiled(fn, device: torch.device):
    """`fn` through torch.compile for this device type, made at its first use."""
    key = (device.type, fn)
    if key not in _FUNCTIONS:
        mode = "reduce-overhead" if device.type == "cuda" else None
        # dynamic=False: every shape is static except those marked dynamic (the cache lengths, on a CPU)
        _FUNCTIONS[key] = torch.compile(fn, mode=mode, dynamic=False)
    return _FUNCTIONS[key]


def step_for(model, device: torch.device) -> CompiledStep:
    """The compiled step of this model on this device, made at its first use and kept while the model lives."""
    steps = _STEPS.setdefault(model, {})
    if device not in steps:
        steps[device] = CompiledStep(device)
        if device.type == "cpu":
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            available = _available_memory()
            steps[device].dynamic_tokens = COPIES_PER_STATIC_STEP * weights > available
            if steps[device].dynamic_tokens:
                warnings.warn(f"selfspec: compile=True on a CPU keeps a copy of the weights per compiled pass shape; "
                              f"{COPIES_PER_STATIC_STEP} copies of this model ({weights / 1e9:.1f} GB each) do not fit "
                              f"in the {available / 1e9:.1f} GB available, so every pass of a layer range shares "
                              f"one graph (about half the memory, a few per cent slower).", stacklevel=2)
    return steps[device]


# On a CPU every compiled graph holds its own prepacked copy of the weights it runs (Inductor's freezing), so static
# token counts cost a copy of the model per pass shape: SmolLM2-135M's 0.27 GB grew the process by 2.0 GB over
# 19 shapes of the hybrid. Where this many copies would not fit in the memory available, every pass of a layer range
# shares one graph instead: one copy of the model beside the eager weights. SmolLM2's hybrid then holds 1.3 GB instead
# of 2.7 GB and runs 3-8 % slower; Qwen2.5-Coder-1.5B's holds 7.1 GB (3.6 GB of weights).
COPIES_PER_STATIC_STEP = 8


def _available_memory() -> float:
    """Bytes of memory available to this process now (Linux's MemAvailable), or infinity where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def forget(model) -> None:
    """Drop a model's compiled steps and every graph Dynamo holds (they hold the weights as compiled)."""
    _STEPS.pop(model, None)
    torch._dynamo.reset()


def compiled_so_far(model) -> dict:
    """Graphs Dynamo has compiled in this process, and pass shapes this model's compiled steps have met on every
    device (recompiles included): what a bench reads before and after its timed runs."""
    from torch._dynamo.utils import counters

    shapes = sum(len(step._seen) + step.recompiles for step in _STEPS.get(model, {}).values())
    return {"dynamo_frames": counters["frames"]["ok"], "selfspec_shapes": shapes}


def warmup_seconds(model) -> float:
    """Seconds this model's passes have spent compiling so far, on every device."""
    return sum(step.warmup_seconds for step in _STEPS.get(model, {}).values())


class CompiledStep:
    """The compiled passes of one model on one device; kept across generate calls and wraps (step_for)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        # exit head -> (its number here, its weights' (address, version) when compiled): a head whose weights
        # moved since runs eager, as the graph holds them as they were; the number keeps a new head that reuses
        # a dead one's id from skipping the guards of the first call
        self._heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._head_count = 0
        # id of a head's gathered LM-head rows -> (a weak reference to them, their number, their module): a new
        # gather (the LM head changed) is a new module and graph (tensors compare by value, so no WeakKeyDictionary)
        self._rows: dict[int, tuple] = {}
        self._row_modules = 0
        self.warmup_seconds = 0.0
        self._seen: set = set()  # shapes compiled so far: a new one is timed as warm-up
        self._announced = False
        self.recompiles = 0  # passes of a shape compiled before that compiled again (none expected)
        self.buckets = BUCKETS
        self.dynamic_tokens = False  # CPU only: one graph per layer range where memory is short (step_for)
        # CUDA only: the smallest buffer a call allocates. CUDA graphs read the whole buffer, so its size is part
        # of every layer graph; the warm-up raises this to the size its longest call needs, which every call up to
        # that length then shares.
        self.least_capacity = 0

    def size(self, tokens: int) -> tuple[int | None, int | str]:
        """(rows a pass of `tokens` tokens runs, its shape's key): the bucket, padded to; with dynamic_tokens the
        tokens themselves (at least 2), every pass sharing one graph whose token count is dynamic (None: eager)."""
        if not self.dynamic_tokens:
            tb = bucket(tokens, self.buckets)
            return tb, tb
        # a single token runs padded to two rows: a dimension of size 1 would specialise (a graph, and a copy of
        # the weights, of its own), and a second row costs little where reading the weights bounds the pass
        return (max(tokens, 2) if tokens <= BUCKETS[-1] else None), "T"

    def mark_tokens(self, *dims) -> None:
        """With dynamic_tokens, mark the token dimension of each (tensor, dim) dynamic."""
        if self.dynamic_tokens:
            for tensor, dim in dims:
                torch._dynamo.mark_dynamic(tensor, dim)

    def fit(self, *sizes: int) -> None:
        """Add exact buckets for the pass sizes a call makes most (its full verify passes)."""
        self.buckets = tuple(sorted(set(self.buckets) | {n for n in sizes if 1 <= n <= BUCKETS[-1]}))

    def capacity(self, needed: int) -> int:
        """KV slots to allocate for a call whose longest sequence needs `needed`: room for a padded pass past it,
        plus one (a read length equal to the whole buffer would be a shape of its own); a power of two on CUDA."""
        slots = needed + BUCKETS[-1] + 1
        return max(1 << (slots - 1).bit_length(), self.least_capacity) if self.cuda else slots

    def mark_cache(self, masks: list, buffers: tuple) -> None:
        """Mark a layer pass's (B, 1, Tb, S) masks and (B, heads, capacity, head_dim) KV buffers: on a CPU the read
        length S and the buffers' size (a call's longest sequence) vary without recompiling; on CUDA the graphs
        replay fixed addresses, so the buffers they write in place are marked as such."""
        if not self.cuda:
            for mask in masks:
                torch._dynamo.mark_dynamic(mask, 3)
            for buffer in buffers:
                torch._dynamo.mark_dynamic(buffer, 2)
        else:
            for buffer in buffers:
                torch._dynamo.mark_static_address(buffer)

    def call(self, fn, key, *args):
        """The compiled `fn` on `args`; `key` names the shape, whose first call is timed as warm-up."""
        fn = _compiled(fn, self.device)
        first = key not in self._seen
        start = time.perf_counter() if first else 0.0
        try:
            out = self._guarded_call(fn, args, skip_guards=not first)
        except RuntimeError as err:  # a shape compiled before asked to compile again: let it, and count it
            if "skip_guard_eval_unsafe" not in str(err):
                raise
            self.recompiles += 1
            out = self._guarded_call(fn, args, skip_guards=False)
        if first:
            self._seen.add(key)
            self.warmup_seconds += time.perf_counter() - start
        return out

    def _guarded_call(self, fn, args, skip_guards: bool):
        with contextlib.ExitStack() as scope:
            scope.enter_context(torch._dynamo.config.patch(recompile_limit=MAX_GRAPHS, automatic_dynamic_shapes=False))
            if not self.cuda:  # prepack the weights for oneDNN; on CUDA the weights are used as they are
                scope.enter_context(torch._inductor.config.patch(freezing=True))
            if skip_guards:  # a shape compiled before: check only the guards that tell its graph from the others'
                scope.enter_context(torch.compiler.set_stance("default", skip_guard_eval_unsafe=True))
            return fn(*args)

    def runs(self, tokens: int) -> bool:
        """Whether a pass of `tokens` tokens outside the layers (an LM head, an exit head) runs compiled."""
        return self.size(tokens)[0] is not None and not torch.is_grad_enabled()

    def _token_pass(self, fn, key: tuple, *args) -> torch.Tensor | None:
        """The compiled `fn` on `args`, whose tensors are (B, T, H) states, its shape keyed by `key` plus
        (B, the pass's size): each tensor padded to the pass's rows (and marked, with dynamic_tokens), the T real
        rows of its output returned; None where it runs eager (runs)."""
        b, t, _ = next(a for a in args if isinstance(a, torch.Tensor)).shape
        if not self.runs(t):
            return None
        tb, size = self.size(t)
        args = [padded(a, tb) if isinstance(a, torch.Tensor) else a for a in args]
        self.mark_tokens(*((a, 1) for a in args if isinstance(a, torch.Tensor)))
        out = self.call(fn, (*key, b, size), *args)
        return self.real_rows(out, t)

    def real_rows(self, out: torch.Tensor, t: int) -> torch.Tensor:
        """A padded output's first t rows (copied on CUDA, where the graph reuses its output's memory)."""
        return out[:, :t].clone() if self.cuda else out[:, :t]

    def logits(self, adapter, normed: torch.Tensor) -> torch.Tensor | None:
        """The LM head over (B, T, H) states through the compiled head, or None where it does not run compiled."""
        return self._token_pass(head_logits, ("logits",), adapter, normed)

    def module_number(self, module) -> int | str | None:
        """The number that keys `module`'s graphs (an exit head, a head's own layer), or None where its weights moved
        since its first compiled call (the graph holds them as they were: it runs eager). A module without weights,
        the plain exit made anew by each call, is keyed by its class: one graph serves every head of its kind."""
        weights = tuple((p.data_ptr(), p._version) for p in module.parameters())
        if not weights:
            return type(module).__name__
        if module not in self._heads:
            self._head_count += 1
            self._heads[module] = (self._head_count, weights)
        number, compiled_weights = self._heads[module]
        return number if weights == compiled_weights else None

    def head_normed(self, head, adapter, hidden: torch.Tensor, prev_top: torch.Tensor | None) -> torch.Tensor | None:
        """ExitHead.normed of (B, T, H) layer-E states through the compiled head, or None where it runs eager."""
        if not self.runs(hidden.shape[1]):  # first: a head called in training is not recorded mid-change
            return None
        number = self.module_number(head)
        if number is None:
            return None
        prev = None if prev_top is None else prev_top.to(hidden.device)
        return self._token_pass(exit_head_output, ("head", number, prev is None), head, adapter, hidden, prev)

    def row_logits(self, rows: torch.Tensor, normed: torch.Tensor) -> torch.Tensor | None:
        """(B, T, H) normed states times the (V_draft, H) LM-head `rows` through the compiled product, or None."""
        if not self.runs(normed.shape[1]):
            return None
        entry = self._rows.get(id(rows))
        if entry is None or entry[0]() is not rows:
            module = torch.nn.Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
            module.weight = torch.nn.Parameter(rows, requires_grad=False)
            self._row_modules += 1
            entry = self._rows[id(rows)] = (weakref.ref(rows), self._row_modules, module)
            weakref.finalize(rows, self._rows.pop, id(rows), None)
        _, number, module = entry
        return self._token_pass(row_logits, ("rows", number), module, normed.to(rows.device))

    def announce(self) -> None:
        if not self._announced and self.warmup_seconds > 0:
            self._announced = True
            warnings.warn(f"selfspec: compiling the step (the first passes of each shape compile; "
                          f"{self.warmup_seconds:.0f} s so far); later calls reuse the graphs.", stacklevel=2)


def padded(x: torch.Tensor, tb: int) -> torch.Tensor:
    """(B, T, H) -> (B, Tb, H) with zero rows after the T real ones, with fresh strides (dense)."""
    b, t, h = x.shape
    return dense(x if tb == t else torch.cat([x, x.new_zeros(b, tb - t, h)], dim=1))


def dense(x: torch.Tensor) -> torch.Tensor:
    """x with the strides of a new tensor of its shape: strides are part of a graph's guards, and a slice of size 1
    in a dimension is contiguous with any stride there."""
    return x.new_empty(x.shape).copy_(x)


def padded_mask(real, q_start: int, t: int, tb: int, length: int, dtype, impl: str) -> torch.Tensor:
    """(B, 1, Tb, length) mask from the real queries' (B, 1, t, q_start + t) boolean mask: padding rows see their
    own slot only, and no row sees a slot past the real ones."""
    b = real.shape[0]
    mask = real.new_zeros(b, 1, tb, length)
    mask[:, :, :t, : q_start + t] = real
    if tb > t:
        own = torch.arange(t, tb, device=real.device)
        mask[:, :, own, q_start + own] = True
    if impl == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)
