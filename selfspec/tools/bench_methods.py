"""The methods `selfspec bench` runs: Hugging Face's own (plain, compiled, assisted) and selfspec's drafters.

A method turns a batch of prompts into tokens and the time of one `generate` call (Outcome); METHODS names them,
and adding a drafter to the benchmark is one line there. The harness (bench.py) gives each method the model, the
shared settings and the heads.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..config import SelfSpecConfig
from .verdict import verify_chunk

if TYPE_CHECKING:
    from .bench import Batch, BenchConfig, Harness

BASELINE = "hf-greedy"  # every method's speed is a ratio to this one's, its tokens the reference
ORACLE = "oracle"

@dataclass
class Outcome:
    rows: list[list[int]]  # generated tokens per row, cut after the first EOS
    seconds: float
    verify_steps: int | None = None  # full-model passes (prefill included); None when unknown
    drafted: int | None = None
    accepted: int | None = None
    rounds: int | None = None  # the oracle's runs until its reference was its own output


class Method:
    """One way of generating. `run` returns the tokens and the time of one `generate` call on a batch."""

    description = ""
    compile = False  # runs compiled: minutes of warm-up, so only when asked for by name
    hf_assisted = False  # Hugging Face's assisted generation supports batch size 1 only

    def run(self, h: "Harness", batch: Batch, reference: list[list[int]] | None, max_new: int) -> Outcome:
        raise NotImplementedError

    def verify_chunk(self, h: "Harness") -> int:
        """Most tokens one of its verify passes runs: the pass shape its half-precision near-ties are judged
        against (tools.verdict). Without a shape of its own, the base config's chain."""
        return h.base_config.max_draft_tokens + 1


class HFMethod(Method):
    """The unwrapped model's own `generate`, with extra kwargs (assisted generation) from the harness."""

    def __init__(self, description: str, extra: Callable[["Harness"], dict] | None = None,
                 chunk: Callable[["Harness"], int] | None = None, assisted: bool = True, compile: bool = False):
        self.description, self.extra, self.chunk = description, extra, chunk
        self.hf_assisted = extra is not None and assisted
        self.compile = compile

    def verify_chunk(self, h):
        return self.chunk(h) if self.chunk else super().verify_chunk(h)

    def run(self, h, batch, reference, max_new):
        counter = CandidateCounter()
        with counter.attached(h.model):
            rows, seconds = h.timed_generate(batch, max_new, **(self.extra(h) if self.extra else {}))
        new = sum(len(r) for r in rows)
        if not self.hf_assisted:
            return Outcome(rows, seconds, verify_steps=new, drafted=0, accepted=0)  # one full pass per token
        # every assisted step emits its accepted candidates plus one token of the target's own
        accepted = max(0, min(counter.drafted, new - counter.steps))
        return Outcome(rows, seconds, verify_steps=counter.steps, drafted=counter.drafted, accepted=accepted)


class EngineMethod(Method):
    """The model wrapped by selfspec with a drafter; `trained` adds the heads/config of --heads (or shipped)."""

    def __init__(self, description: str, drafter: str, trained: bool = False, oracle: bool = False,
                 tree: bool = False, compile: bool = False, no_heads: bool = False):
        self.description, self.drafter, self.trained, self.oracle = description, drafter, trained, oracle
        self.tree = tree  # draft trees (the calibrated tree shape, else DEFAULT_TREE)
        # no_heads: the config `selfspec.wrap(model)` runs given neither heads nor a config, as a user first meets it
        self.no_heads = no_heads
        # compile: the engine's compiled step (compiled.py), its compile time left out of the time measured (the
        # warm-up a server pays once)
        self.compile = compile

    def variant(self, description: str, **changes) -> "EngineMethod":
        fields = dict(description=description, drafter=self.drafter, trained=self.trained, oracle=self.oracle,
                      tree=self.tree, compile=self.compile, no_heads=self.no_heads)
        return EngineMethod(**{**fields, **changes})

    def config(self, h) -> SelfSpecConfig:
        if self.no_heads:
            from ..wrap import UNTRAINED_DEFAULT

            return SelfSpecConfig(**UNTRAINED_DEFAULT)
        return h.engine_config(self.drafter, self.trained, self.tree)

    def verify_chunk(self, h):
        return verify_chunk(self.config(h))

    def run(self, h, batch, reference, max_new):
        if self.oracle:
            return self.run_oracle(h, batch, reference, max_new)
        return self.run_once(h, batch, max_new)

    def run_once(self, h, batch, max_new, oracle_rows=None) -> Outcome:
        config = self.config(h)
        compiled = self.compile or h.cfg.compile
        return self._run_wrapped(h, batch, max_new, config.replace(compile=compiled), oracle_rows)

    def warm_up(self, h, max_length: int) -> float:
        """Compile every pass shape of this method's config before the first timed run (SelfSpecEngine.warmup);
        seconds it took, 0 for a method that runs eager."""
        import selfspec

        config = self.config(h)
        if not (self.compile or h.cfg.compile) or self.oracle:
            return 0.0
        selfspec.wrap(h.model, config.replace(compile=True))
        try:
            for head in (h.heads.values() if self.trained else ()):
                h.model.selfspec.add_head(head)
            return h.model.selfspec.warmup(max_length=max_length, progress=False)
        finally:
            selfspec.unwrap(h.model)

    def _run_wrapped(self, h, batch, max_new, config, oracle_rows) -> Outcome:
        import selfspec
        from ..drafters.oracle import OracleDrafter

        selfspec.wrap(h.model, config)
        try:
            engine = h.model.selfspec
            for head in (h.heads.values() if self.trained else ()):
                engine.add_head(head)
            if oracle_rows is not None:
                engine.drafter_override = OracleDrafter.from_rows(oracle_rows)
            rows, seconds = h.timed_generate(batch, max_new)
            stats = engine.last_stats
        finally:
            selfspec.unwrap(h.model)
        if stats is None:
            raise RuntimeError(f"selfspec fell back to the plain generate for drafter {self.drafter!r} (see the "
                               f"warning above), so this method would measure Hugging Face instead of selfspec.")
        return Outcome(rows, seconds, stats.verify_steps, stats.drafted_tokens, stats.accepted_tokens)

    def run_oracle(self, h, batch, reference, max_new, max_rounds: int = 6) -> Outcome:
        """Draft the verifier's own output. Plain greedy's output is the first reference; in half precision the
        verifier's multi-token passes can part from it at a near-tie, so run again with the previous run's output
        as reference until a run reproduces its reference (every draft accepted); that run is the one timed."""
        rows = reference
        for rounds in range(1, max_rounds + 1):
            outcome = self.run_once(h, batch, max_new, oracle_rows=rows)
            if outcome.rows == rows:
                break
            rows = outcome.rows
        outcome.rounds = rounds
        return outcome


def _static_compiled(h) -> dict:
    """generate() arguments for Hugging Face's own compiled decoding: a static cache, its forward compiled (on every
    device: transformers compiles on CUDA only unless told)."""
    from transformers import CompileConfig

    config = CompileConfig(mode="reduce-overhead" if h.model.device.type == "cuda" else "default")
    config._compile_all_devices = True
    return {"cache_implementation": "static", "compile_config": config}


# name -> method. Adding a drafter to the benchmark is one line here.
METHODS: dict[str, Method] = {
    "hf-greedy": HFMethod("plain model.generate (the 1.00x baseline)"),
    "hf-greedy-compiled": HFMethod("plain model.generate with Hugging Face's static cache and torch.compile "
                                   "(its compile_config), the stronger baseline", _static_compiled, assisted=False,
                                   compile=True),
    "hf-early-exit": HFMethod("Hugging Face assistant_early_exit=E (E chosen on train-split prompts)",
                              lambda h: {"assistant_early_exit": h.hf_exit_layer}),
    "hf-prompt-lookup": HFMethod("Hugging Face prompt_lookup_num_tokens=N",
                                 lambda h: {"prompt_lookup_num_tokens": h.cfg.prompt_lookup_tokens},
                                 chunk=lambda h: h.cfg.prompt_lookup_tokens + 1),
    "selfspec-untrained": EngineMethod("selfspec, norm + LM-head exit at E", "early_exit"),
    "selfspec": EngineMethod("selfspec with trained heads/config (--heads or shipped)", "early_exit", trained=True),
    "selfspec-ar": EngineMethod("selfspec loop with drafting off (engine overhead)", "none"),
    "oracle": EngineMethod("selfspec loop drafting the true greedy continuation (upper bound)", "oracle",
                           oracle=True),
    "selfspec-ngram": EngineMethod("selfspec, prompt-lookup n-gram drafter", "ngram"),
    "selfspec-no-heads": EngineMethod("selfspec.wrap(model) given no heads or config: its untrained default", "ngram",
                                      no_heads=True),
    "selfspec-hybrid": EngineMethod("selfspec, n-gram or early-exit drafter per row", "hybrid", trained=True),
    "selfspec-tree": EngineMethod("selfspec with trained heads, drafting trees", "early_exit", trained=True,
                                  tree=True),
    "selfspec-hybrid-tree": EngineMethod("selfspec hybrid drafting trees: n-gram branches and the head's tree",
                                         "hybrid", trained=True, tree=True),
}


# The tree shape of a tree method when the calibration recorded none for its drafter (per_drafter["<drafter>-tree"]).
# The same drafters through the compiled step (compiled.py), to run beside their eager selves
for _name in ("selfspec", "selfspec-ngram", "selfspec-hybrid", "selfspec-tree"):
    METHODS[f"{_name}-compiled"] = METHODS[_name].variant(METHODS[_name].description + ", compiled step",
                                                          compile=True)

DEFAULT_TREE = {"draft_tree_top_k": 4, "draft_tree_size": 16}
CORE_METHODS = ("hf-greedy", "hf-early-exit", "hf-prompt-lookup", "selfspec-untrained", "selfspec", "selfspec-ar",
                "oracle")


def drafter_available(method: Method) -> bool:
    from ..drafters import DRAFTERS

    return not isinstance(method, EngineMethod) or method.drafter in DRAFTERS


def default_methods(registry: dict[str, Method] = METHODS) -> tuple:
    """The core methods plus every other registered method whose drafter exists in this checkout."""
    extra = [n for n in registry if n not in CORE_METHODS and drafter_available(registry[n])
             and not registry[n].compile]  # compiling takes minutes: asked for by name
    return CORE_METHODS + tuple(extra)


def select_methods(cfg: BenchConfig, registry: dict[str, Method]) -> tuple[list[str], dict[str, str]]:
    """Methods to run (baseline first) and {method: why skipped}."""
    names = list(dict.fromkeys(cfg.methods or default_methods(registry)))
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise ValueError(f"Unknown method(s) {unknown}; available: {sorted(registry)}.")
    missing = [n for n in names if not drafter_available(registry[n])]
    if missing:
        raise ValueError(f"Method(s) {missing} need drafters not registered in this checkout; available methods: "
                         f"{[n for n in registry if drafter_available(registry[n])]}.")
    skipped = {}
    if cfg.batch_size > 1:
        skipped = {n: "Hugging Face assisted generation supports batch size 1 only"
                   for n in names if registry[n].hf_assisted}
    names = [BASELINE] + [n for n in names if n != BASELINE and n not in skipped]
    return names, skipped


class CandidateCounter:
    """Counts assisted generation's steps and drafted tokens by wrapping the candidate generator HF builds."""

    def __init__(self):
        self.steps = self.drafted = 0

    @contextlib.contextmanager
    def attached(self, model):
        original = model._get_candidate_generator

        def counting_generator(*args, **kwargs):
            generator = original(*args, **kwargs)
            get_candidates = generator.get_candidates

            def counted(input_ids, *a, **kw):
                candidates, logits = get_candidates(input_ids, *a, **kw)
                self.steps += 1
                self.drafted += candidates.shape[1] - input_ids.shape[1]
                return candidates, logits

            generator.get_candidates = counted
            return generator

        model._get_candidate_generator = counting_generator  # instance attribute: the class is untouched
        try:
            yield self
        finally:
            del model._get_candidate_generator
def engine_settings(config: SelfSpecConfig) -> str:
    """A method's drafting setting in one short phrase, for the report."""
    parts = [f"K={config.max_draft_tokens}"]
    if config.drafter in ("early_exit", "hybrid"):
        parts.insert(0, f"E={config.exit_layer}")
        if config.draft_confidence_threshold:
            path = " on the path" if config.draft_confidence_cumulative and config.draft_tree_top_k == 1 else ""
            parts.append(f"threshold {config.draft_confidence_threshold:g}{path}")
    if config.draft_tree_top_k > 1:
        parts.append(f"trees of top-{config.draft_tree_top_k}, {config.draft_tree_size} nodes")
    elif config.drafter in ("early_exit", "hybrid") and config.copy_draft_tokens > config.max_draft_tokens:
        parts.append(f"runs to {config.copy_draft_tokens} while copying")
    if config.drafter in ("ngram", "hybrid"):
        parts.append(f"n-gram {config.ngram_min}..{config.ngram_max}")
    if config.drafter == "hybrid":
        parts.append(f"{config.hybrid_policy}, min match {config.hybrid_min_match}")
    return ", ".join(parts) if config.drafter != "none" else "no drafts"
