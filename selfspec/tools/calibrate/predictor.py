"""The cost model's view of the search space: predicted tokens/s of every early-exit and prompt-lookup setting from
cost_model.py (the loop replayed over teacher-forced agreement, and micro-timings), so that the study measures the
predicted best first and prunes settings predicted far below the best measured."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ...config import SelfSpecConfig
from ...drafters.base import ConfidenceRule
from .. import cost_model
from ..measure import eos_ids_of
from .space import MeasureSpec, SearchSpace, effective_params, tree_key, trial_config
from .trials import generate_once


MODELLED_DRAFTERS = ("early_exit", "ngram")  # hybrid mixes both per row and step: measured only


def _param_key(params: dict) -> tuple:
    return tuple(sorted((k, round(v, 10) if isinstance(v, float) else v) for k, v in params.items()))


@dataclass
class Predictor:
    """Predicted tokens/s of early-exit and prompt-lookup settings, from the replayed loop and the timings."""

    timings: cost_model.Timings
    sequences: list[cost_model.Sequence]
    eos: list[list[bool]]  # [sequence][answer token] is an EOS id
    acceptance: dict[int, cost_model.LayerAcceptance]
    ngram: dict = field(default_factory=dict)  # ngram_min, eos_ids, k_max, lookup_seconds (None: not modelled)
    max_new_tokens: int | None = None  # what the answers were generated with (the loop's draft budget reads it)
    grid: dict[tuple, tuple[dict, cost_model.Prediction]] = field(default_factory=dict)
    _proposals: dict[int, list] = field(default_factory=dict)

    def predict(self, params: dict) -> cost_model.Prediction | None:
        key = _param_key(params)
        if key not in self.grid:
            prediction = self._compute(params)
            if prediction is None:
                return None
            self.grid[key] = (dict(params), prediction)
        return self.grid[key][1]

    def _compute(self, params: dict) -> cost_model.Prediction | None:
        drafter = params.get("drafter")
        if drafter == "early_exit" and params["exit_layer"] in self.acceptance:
            run = effective_params(params)  # the setting as the engine runs it (a tree's size raised to K)
            tree = (run.get("draft_tree_top_k", 1), run.get("draft_tree_size", 0))
            return cost_model.predict(self.acceptance[run["exit_layer"]], self.eos, self.timings,
                                      run["max_draft_tokens"],
                                      ConfidenceRule(run["draft_confidence_threshold"],
                                                     run.get("draft_confidence_cumulative", False)),
                                      self.max_new_tokens, tree, run.get("copy_draft_tokens", 0))
        if drafter == "ngram" and self.ngram.get("lookup_seconds") is not None:
            counts = cost_model.simulate_ngram(self.sequences, self._ngram_proposals(params["ngram_max"]), self.eos,
                                               params["max_draft_tokens"], self.max_new_tokens)
            return cost_model.predict_ngram(counts, self.timings, self.ngram["lookup_seconds"])
        return None

    def _ngram_proposals(self, n_max: int) -> list:
        if n_max not in self._proposals:
            n_min = min(self.ngram["ngram_min"], n_max)
            self._proposals[n_max] = [cost_model.ngram_proposals(s, self.ngram["k_max"], n_max, n_min,
                                                                 self.ngram["eos_ids"]) for s in self.sequences]
        return self._proposals[n_max]

    def fill(self, space: SearchSpace) -> None:
        ks = space.max_draft_tokens
        if "early_exit" in space.drafters:
            for e in space.exit_layers:
                for k in ks:
                    for thr in space.threshold_grid():
                        for top_k, size in (space.tree_shapes() if space.searches_trees else [(None, 0)]):
                            chain = (top_k or 1) == 1
                            copy_ks = space.copy_draft_tokens if chain and space.copy_draft_tokens != [0] else [None]
                            for cumulative in (space.cumulative if chain else [None]):
                                for copy_k in copy_ks:
                                    self.predict(_early_params(e, k, thr, top_k, size, cumulative, copy_k))
        if "ngram" in space.drafters:
            for k in ks:
                for n in space.ngram_max:
                    self.predict({"drafter": "ngram", "max_draft_tokens": k, "ngram_max": n})

    def best(self, top: int) -> list[tuple[dict, cost_model.Prediction]]:
        """The `top` best predictions, one per (drafter, exit layer, K, tree or not), plus the best of each
        drafter (trees counted apart from chains)."""
        ranked = sorted(self.grid.values(), key=lambda item: item[1].tokens_per_s, reverse=True)
        picked, groups = [], set()
        for params, prediction in ranked:
            group = (params["drafter"], params.get("exit_layer"), params["max_draft_tokens"],
                     params.get("draft_tree_top_k", 1))
            if group not in groups and len(picked) < top:
                groups.add(group)
                picked.append((params, prediction))
        for key in {tree_key(p) for p, _ in ranked} - {tree_key(p) for p, _ in picked}:
            picked.append(next(item for item in ranked if tree_key(item[0]) == key))
        return picked

    def plain_tokens_per_s(self) -> float:
        """The engine with no drafts (drafter "none"), for a sanity check of the timings against plain generate."""
        new = sum(s.answer.numel() for s in self.sequences)
        return new / cost_model.plain_seconds(self.timings, new, len(self.sequences))

    def profile_summary(self, max_k: int) -> dict:
        return {str(e): {"agreement": round(a.agreement, 4),
                         "position_profile": [round(p, 4) for p in a.position_profile(max_k)]}
                for e, a in self.acceptance.items()}


def _early_params(exit_layer: int, k: int, threshold: float, top_k: int | None = None, size: int = 0,
                  cumulative: bool | None = None, copy_k: int | None = None) -> dict:
    """The params `suggest` gives an early-exit trial: tree keys only when the space searches trees, the chain's
    confidence rule only for chains, and their copy runs only when the space searches them."""
    params = {"drafter": "early_exit", "exit_layer": exit_layer, "max_draft_tokens": k,
              "draft_confidence_threshold": threshold}
    if top_k is not None:
        params["draft_tree_top_k"] = top_k
    if top_k is not None and top_k > 1:
        params["draft_tree_size"] = size
    if cumulative is not None:
        params["draft_confidence_cumulative"] = cumulative
    if copy_k is not None:
        params["copy_draft_tokens"] = copy_k
    return params


def _engine_seconds(model, config: SelfSpecConfig, prompt, new_tokens: int, repeats: int = 2) -> dict:
    """Draft seconds per drafted token and per step, verify seconds per step, of the fastest of short runs."""
    model.selfspec.config = config
    best = None
    for _ in range(repeats):
        generate_once(model, prompt, new_tokens, plain=False)
        s = model.selfspec.last_stats
        if best is None or s.draft_seconds + s.verify_seconds < best.draft_seconds + best.verify_seconds:
            best = s
    steps = max(best.verify_steps - 1, 1)  # verify_steps counts the prefill too
    return {"draft_token": best.draft_seconds / max(best.drafted_tokens, 1), "draft_step": best.draft_seconds / steps,
            "verify_step": best.verify_seconds / steps}


def loop_probe_configs(base: SelfSpecConfig, space: SearchSpace) -> dict[str, SelfSpecConfig]:
    """The short engine runs _loop_overheads times, by what each measures: no drafts ("none_step"), early-exit
    chains ("draft_token") and n-gram lookups ("lookup_step"), for the drafters the space holds. All are chains
    whatever tree shape `base` carries: the cost model prices a drafted token of a chain and a lookup per step,
    and a tree's nodes share level passes (a top-4 tree of 4 nodes at K=2 drafts 4 nodes in 2 passes, which
    would halve the time a drafted token seems to take)."""
    chain = base.replace(draft_tree_top_k=1)
    out = {"none_step": chain.replace(drafter="none")}
    if "early_exit" in space.drafters:
        out["draft_token"] = chain.replace(drafter="early_exit", exit_layer=space.exit_layers[0], max_draft_tokens=2,
                                           draft_confidence_threshold=0.0)
    if "ngram" in space.drafters:
        out["lookup_step"] = trial_config(chain, {"drafter": "ngram", "max_draft_tokens": space.max_draft_tokens[-1],
                                                  "ngram_max": space.ngram_max[-1]})
    return out


def _loop_overheads(model, base: SelfSpecConfig, prompt, space: SearchSpace, new_tokens: int) -> dict:
    """Per-step costs the micro-timings miss, from short engine runs (loop_probe_configs): verify seconds per step
    without drafts, draft seconds per early-exit token, prompt-lookup seconds per step."""
    part = {"none_step": "verify_step", "draft_token": "draft_token", "lookup_step": "draft_step"}
    out = {name: _engine_seconds(model, config, prompt, new_tokens)[part[name]]
           for name, config in loop_probe_configs(base, space).items()}
    model.selfspec.config = base
    return out


@torch.no_grad()
def build_predictor(model, base: SelfSpecConfig, prompts, answers, space: SearchSpace, measure: MeasureSpec,
                    log) -> Predictor | None:
    if not set(space.drafters) & set(MODELLED_DRAFTERS):
        return None
    if measure.sample:  # its acceptance is replayed against greedy answers: a sampled run accepts other drafts
        log("cost model: off when sampling (it replays greedy acceptance); every trial is measured")
        return None
    engine = model.selfspec
    t0 = time.perf_counter()
    sequences = [cost_model.Sequence(p, a.to(p.device)) for p, a in zip(prompts, answers) if a.numel()]
    exits = space.exit_layers if "early_exit" in space.drafters else []
    acceptance = cost_model.measure_acceptance(engine, sequences, exits) if exits else {}
    widest = max([space.max_draft_tokens[-1]] + [n for t, n in space.tree_shapes() if t > 1])  # nodes per pass
    timings = cost_model.measure_timings(engine, prompts, exits, widest + 1, measure.timing_repeats)
    loop = _loop_overheads(model, base, prompts[0], space, min(16, measure.max_new_tokens))
    timings = cost_model.fit_overheads(timings, loop["none_step"], loop.get("draft_token"),
                                       exits[0] if exits else None)
    eos_ids = eos_ids_of(model)
    eos = [[int(t) in set(eos_ids) for t in s.answer.tolist()] for s in sequences]
    ngram = {"ngram_min": base.ngram_min, "eos_ids": eos_ids, "k_max": space.max_draft_tokens[-1],
             "lookup_seconds": loop.get("lookup_step")}
    predictor = Predictor(timings, sequences, eos, acceptance, ngram, measure.max_new_tokens)
    predictor.fill(space)
    log(f"cost model: {len(exits)} exit layers profiled, {len(predictor.grid)} settings predicted "
        f"in {time.perf_counter() - t0:.1f}s")
    return predictor
