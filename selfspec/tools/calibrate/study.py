"""The Optuna study: opened or resumed for one model, device and dtype; trials suggested from the space, predicted,
pruned or measured; the best settings re-timed against plain `generate`; `calibrate` runs it all."""
from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ...config import CALIBRATION_KEY, SelfSpecConfig
from ...wrap import wrap
from ..measure import environment as measure_environment
from ..measure import model_identity
from .budget import search_timeout
from .predictor import MODELLED_DRAFTERS, Predictor, build_predictor
from .report import REPORT_NAME, build_report, save_result
from .space import (EXIT_DRAFTERS, SearchSpace, SearchSpec, describe, effective_params, in_space, kind_params,
                    kinds, resolve_space, suggest, trial_config, tree_key)
from ..verdict import DIFFERS, NEAR_TIE, PlainLogits, verify_chunk
from .trials import Measurement, exactness, generate_once, pad_id_of, time_generation, time_setting


def study_identity(model, name: str | None) -> dict:
    """What a study's trials were measured on: the model (measure.model_identity), the layers of the heads it
    drafts with and a fingerprint of their weights (new heads at the same layers are another setup)."""
    heads = model.selfspec.heads
    fingerprint = {str(e): round(float(sum(p.detach().double().abs().sum() for p in heads[e].parameters())), 3)
                   for e in sorted(heads)}
    return {**model_identity(model, name), "heads": sorted(heads), "head_weights": fingerprint}


# what a study stored before its identity recorded a key was made with: every such study decoded greedily, ran
# eager (a compiled step's passes cost less, so its trials are another setup's) and had no folded attention
_IMPLIED = {"decoding": "greedy", "folded_gqa": False, "compile": False}
# keys that identities stored by earlier versions may hold for speed layers selfspec no longer has (prepacked bf16
# weights, a small-row matmul kernel), at the value every setup has now: a study timed with one of them on was
# another setup's and is refused, one timed without them resumes
_RETIRED = {"packed": False, "small_gemm": False}


def environment(model) -> dict:
    return measure_environment(next(model.parameters()).device, ("optuna",))


def open_study(storage: str, study_name: str, identity: dict, seed: int, startup: int):
    """Create the study or resume it; a stored study made for another model, device or decoding is refused. A study
    stored before the identity recorded a key (the LM-head fingerprint came later) is compared on the keys it has,
    and on what it implies for the others (_IMPLIED); one that records a speed layer since removed, on what every
    setup has now (_RETIRED)."""
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, group=True)
    study = optuna.create_study(study_name=study_name, storage=storage, direction="maximize", sampler=sampler,
                                load_if_exists=True)
    stored = study.user_attrs.get("identity")
    known = {**_IMPLIED, **stored} if stored is not None else {}
    now = {**_RETIRED, **identity}
    diff = {k: (known[k], now[k]) for k in now if k in known and known[k] != now[k]}
    if diff:
        raise ValueError(f"Study {study_name!r} in {storage} was made for another setup (stored vs now: {diff}); "
                         "pass another --study-name or --storage.")
    if stored is None:
        study.set_user_attr("identity", identity)
    return study


def _measured(study) -> list:
    import optuna

    return [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get("measured")]


@dataclass
class Session:
    """Everything a trial needs; `objective` is the Optuna objective."""

    model: object
    base: SelfSpecConfig
    prompts: list[torch.Tensor]
    plain: Measurement
    space: SearchSpace
    spec: SearchSpec
    predictor: Predictor | None
    log: object = print
    measured_this_run: int = 0
    plain_logits: PlainLogits | None = None  # plain generate's logits, for a verdict where an output parts from it

    def objective(self, trial) -> float:
        import optuna

        params = suggest(trial, self.space)
        prediction = self.predictor.predict(params) if self.predictor else None
        if prediction is not None:
            trial.set_user_attr("predicted_tokens_per_s", prediction.tokens_per_s)
            trial.set_user_attr("predicted_mean_accepted_tokens", prediction.mean_accepted_tokens)
            trial.set_user_attr("predicted_acceptance_rate", prediction.acceptance_rate)
        done = _measured(trial.study)
        twin = next((t for t in done if t.params == trial.params), None)
        if twin is not None:  # TPE re-proposed a measured setting: reuse it instead of paying again
            trial.set_user_attr("duplicate_of", twin.number)
            self.log(f"trial {trial.number:3d} {describe(params):40s} = trial {twin.number} ({twin.value:.2f} tok/s)")
            return twin.value
        reason = self.prune_reason(prediction, done)
        if reason:
            trial.set_user_attr("pruned_by_cost_model", reason)
            self.log(f"trial {trial.number:3d} {describe(params):40s} pruned: {reason}")
            raise optuna.TrialPruned(reason)
        config = trial_config(self.base, params)
        m = time_setting(self.model, config, self.prompts, self.spec.measure)
        self.record(trial, m, verify_chunk(config))
        self.measured_this_run += 1
        self.log(self.progress_line(trial, params, m, prediction, done))
        return m.tokens_per_s

    def prune_reason(self, prediction, done) -> str | None:
        """Hopeless when the prediction, rescaled by how far predictions ran off so far, is far below the best."""
        strategy = self.spec.search
        if prediction is None or len(done) < strategy.min_measured:
            return None
        ratios = [t.value / t.user_attrs["predicted_tokens_per_s"] for t in done
                  if t.user_attrs.get("predicted_tokens_per_s")]
        scale = statistics.median(ratios) if ratios else 1.0
        best = max(t.value for t in done)
        expected = prediction.tokens_per_s * scale
        if expected < strategy.prune_below * best:
            return f"predicted {expected:.2f} tok/s < {strategy.prune_below:.2f} x best {best:.2f}"
        return None

    def record(self, trial, m: Measurement, chunk: int) -> None:
        trial.set_user_attr("measured", True)
        for key in ("acceptance_rate", "mean_accepted_tokens", "draft_seconds", "verify_seconds", "prefill_seconds",
                    "new_tokens", "verify_steps", "drafted_tokens", "accepted_tokens"):
            trial.set_user_attr(key, m.stats.get(key))
        trial.set_user_attr("seconds", m.seconds)
        trial.set_user_attr("speedup_vs_plain", m.tokens_per_s / self.plain.tokens_per_s)
        if self.spec.measure.sample:  # sampled outputs differ from plain generate's by chance: nothing to judge
            return
        if self.plain_logits is None:
            self.plain_logits = PlainLogits(self.model, {"pad_token_id": pad_id_of(self.model)})
        counts = exactness(self.model, self.plain_logits, self.prompts, m.outputs, self.plain.outputs, chunk)
        trial.set_user_attr("matches_plain", counts[NEAR_TIE] + counts[DIFFERS] == 0)
        trial.set_user_attr("near_ties", counts[NEAR_TIE])  # parts from plain where half precision rounds a tie
        trial.set_user_attr("differs", counts[DIFFERS])  # a bug: any other divergence

    def progress_line(self, trial, params, m: Measurement, prediction, done) -> str:
        best = max([t.value for t in done] + [m.tokens_per_s])
        pred = f"pred {prediction.tokens_per_s:6.2f}" if prediction else "pred    -  "
        flag = exactness_flag(trial.user_attrs)
        return (f"trial {trial.number:3d} {describe(params):40s} {m.tokens_per_s:6.2f} tok/s ({pred}) "
                f"accept {m.stats['acceptance_rate']:.2f} tok/step {m.stats['mean_accepted_tokens']:.2f} "
                f"| best {best:.2f}, plain {self.plain.tokens_per_s:.2f}{flag}")


def exactness_flag(attrs: dict) -> str:
    """The progress line's note on a trial's greedy outputs: nothing when identical to plain generate's."""
    if attrs.get("differs"):
        return f"  OUTPUT DIFFERS FROM PLAIN on {attrs['differs']} prompt(s): a bug, please report it"
    if attrs.get("near_ties"):
        return f"  {attrs['near_ties']} near-tie(s): half-precision rounding, not a bug"
    return ""


def enqueue_predicted(study, predictor: Predictor | None, space: SearchSpace, top: int, log) -> None:
    """The cost model's best settings first, plus one default trial of each drafter it cannot model."""
    queued = []
    if predictor is not None:
        queued += [params for params, _ in predictor.best(top)]
    k_mid = _nearest(space.max_draft_tokens, 4)
    for drafter in space.drafters:
        if drafter == "none" or (predictor is not None and drafter in MODELLED_DRAFTERS):
            continue
        params = {"drafter": drafter, "max_draft_tokens": k_mid}
        if drafter in EXIT_DRAFTERS:
            early = next((p for p in queued if p["drafter"] == "early_exit"), None)
            params.update({k: early[k] for k in ("exit_layer", "draft_confidence_threshold")} if early else
                          {"exit_layer": space.exit_layers[len(space.exit_layers) // 2],
                           "draft_confidence_threshold": space.thresholds[0]})
            params["draft_confidence_cumulative"] = (early or {}).get("draft_confidence_cumulative",
                                                                      space.cumulative[0])
        params["ngram_max"] = _nearest(space.ngram_max, 3)
        if drafter == "hybrid":
            params["hybrid_min_match"] = _nearest(space.hybrid_min_match, 2)
            params["hybrid_policy"] = space.hybrid_policy[0]
        queued.append(params)
    enqueue_fresh(study, queued, "cost_model", "trials", log)


def enqueue_fresh(study, settings: list, source: str, what: str, log) -> None:
    """Queue the settings the study has not seen (each once), tagged enqueued_by=`source`, and log them as `what`."""
    seen = [t.params for t in study.get_trials(deepcopy=False)]
    fresh = []
    for params in settings:
        if params not in seen and params not in fresh:
            fresh.append(params)
    for params in fresh:
        study.enqueue_trial(params, user_attrs={"enqueued_by": source})
    if fresh:
        log(f"enqueued {len(fresh)} {what}: " + "; ".join(describe(p) for p in fresh))


def enqueue_previous(study, base: SelfSpecConfig, space: SearchSpace, log, sampled: bool = False) -> None:
    """The bests of the calibration the heads' config came from (its per_drafter), measured again: a study over
    new heads or on another day starts from what won before instead of hoping TPE finds it (on calibration
    prompts the top settings often lie within the timer's noise of each other). Entries outside the space are
    skipped. A sampled study starts from the last sampled calibration's bests, else from the greedy one's."""
    previous = base.calibration(sampled).get("per_drafter", {})
    kept = []
    for params in previous.values():
        if params.get("drafter") in EXIT_DRAFTERS and params.get("draft_tree_top_k", 1) == 1:
            params = {"draft_confidence_cumulative": False, **params}  # what a config from before the knob ran
        if in_space(params, space):
            kept.append(params)
    enqueue_fresh(study, kept, "previous_calibration", "previous best(s)", log)


def check_seeds(seeds: list, space: SearchSpace, exits_from_heads: bool = False, log=print) -> list:
    """search.enqueue, checked before anything runs; returns the seeds to queue. A setting outside the space is
    refused: the sampler could never propose it or its neighbours, so its timing would be a point the search cannot
    move from. Where the space's exit layers are the heads' own (`exit_layer: auto`), a seed at an exit layer the
    heads lack is left out with a line instead: a shipped space's seed names the shipped heads' layer, and heads
    trained at other layers are still calibrated."""
    kept = []
    for i, params in enumerate(seeds):
        if not isinstance(params, dict) or "drafter" not in params:
            raise ValueError(f"search.enqueue[{i}] must be a setting with a 'drafter' (as per_drafter writes one), "
                             f"got {params!r}.")
        if not in_space(params, space):
            elsewhere = params.get("exit_layer") not in space.exit_layers and in_space(
                {**params, "exit_layer": space.exit_layers[0]}, space)
            if exits_from_heads and elsewhere:
                log(f"calibrate: search.enqueue[{i}] ({describe(params)}) drafts at exit layer "
                    f"{params['exit_layer']}, where these heads have none (they sit at {space.exit_layers}): "
                    "not enqueued")
                continue
            raise ValueError(f"search.enqueue[{i}] ({describe(params)}) lies outside the space; widen the space "
                             f"or change the setting.")
        kept.append(params)
    return kept


class BalanceKinds:
    """After every second trial, with nothing queued, queue one of the kind of drafting with the fewest trials
    (measured or pruned) so far, its other params left to the sampler. The trials between stay TPE's."""

    def __init__(self, space: SearchSpace, budget: "_Budget | None" = None):
        self.space, self.budget, self.turn = space, budget, 0

    def __call__(self, study, trial) -> None:
        import optuna

        names = kinds(self.space)
        done = study.get_trials(deepcopy=False)
        if (len(names) < 2 or trial.number % 2 == 0 or (self.budget is not None and self.budget.spent())
                or any(t.state == optuna.trial.TrialState.WAITING for t in done)):
            return  # (a trial queued after the last would wait in the storage for the next run)
        finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        count = {name: 0 for name in names}
        for t in done:
            if t.state in finished and tree_key(t.params) in count:
                count[tree_key(t.params)] += 1
        fewest = min(names, key=lambda name: count[name])  # ties: the space's order
        study.enqueue_trial(kind_params(fewest, self.space, self.turn), user_attrs={"enqueued_by": "balance"})
        self.turn += 1


def _nearest(values: list[int], target: int) -> int:
    return min(values, key=lambda v: (abs(v - target), v))


class _Budget:
    """Stop after `trials` measured trials of this run (pruned and duplicate trials are free), with a cap on
    all trials in case everything left is pruned; a progress bar counts the measured ones (with an ETA when the
    count is the budget)."""

    def __init__(self, session: Session, trials: int | None, timeout: float | None = None):
        from tqdm import tqdm

        self.session, self.trials = session, trials
        self.started = 0
        # a timeout alone: the bar counts the search's seconds, so that it ends where the search does
        self.clock = time.monotonic() if trials is None and timeout else None
        self.bar = tqdm(total=trials if self.clock is None else round(timeout), desc="calibrate",
                        unit="trial" if self.clock is None else "s", file=sys.stderr, mininterval=5)
        if timeout and self.clock is None:
            self.bar.set_postfix_str(f"stops within {timeout:.0f} s")

    def __call__(self, study, trial) -> None:
        self.started += 1
        if self.clock is None:
            self.bar.update(self.session.measured_this_run - self.bar.n)
        else:
            self.bar.update(min(round(time.monotonic() - self.clock), self.bar.total) - self.bar.n)
            self.bar.set_postfix_str(f"{self.session.measured_this_run} trials")
        if self.spent():
            study.stop()

    def spent(self) -> bool:
        return self.trials is not None and (self.session.measured_this_run >= self.trials
                                            or self.started >= 10 * self.trials + 20)


def top_settings(study, count: int) -> list:
    done = sorted(_measured(study), key=lambda t: t.value, reverse=True)
    picked, seen = [], []
    for t in done:
        if t.params not in seen:
            seen.append(t.params)
            picked.append(t)
    return picked[:count]


def top_per_kind(study, count: int) -> list:
    """The `count` fastest distinct measured settings of each kind of drafting (tree_key), kind by kind."""
    picked: dict[str, list] = {}
    for t in top_settings(study, len(study.trials)):
        group = picked.setdefault(tree_key(t.params), [])
        if len(group) < count:
            group.append(t)
    return [t for group in picked.values() for t in group]


def final_candidates(study, strategy) -> list:
    """What the final comparison re-times: the overall best final_candidates, then each kind's best
    final_per_kind that are not among them."""
    overall = top_settings(study, strategy.final_candidates)
    return overall + [t for t in top_per_kind(study, strategy.final_per_kind)
                      if all(t.params != o.params for o in overall)]


def best_per_drafter(study, confirmed: list[dict] = ()) -> dict[str, dict]:
    """{drafter: params of its fastest setting}, so that each drafter can be run at its own best setting (an n-gram
    drafter wants other K than an exit head; the bench reads this). Trees count as a drafter of their own,
    "early_exit-tree" or "hybrid-tree", so that a chain's best is kept next to the best tree. A drafter among the
    `confirmed` candidates (re-timed side by side, fastest first) takes its fastest there: the trials' single
    timings are noisier, and the config's own setting must be its drafter's entry."""
    best: dict[str, tuple[float, dict]] = {}
    for t in _measured(study):
        drafter = tree_key(t.params)
        if drafter not in best or t.value > best[drafter][0]:
            best[drafter] = (t.value, effective_params(t.params))
    retimed = {}
    for c in confirmed:
        retimed.setdefault(tree_key(c["params"]), effective_params(c["params"]))
    return {d: retimed.get(d, params) for d, (_, params) in sorted(best.items())}


def confirm(session: Session, candidates: list, rounds: int, log) -> tuple[list[dict], float]:
    """Re-time the best settings and plain generate prompt by prompt, in rotating order, so that load drifting
    over the run (other processes on a shared machine) hits every setting alike."""
    configs = [None] + [trial_config(session.base, t.params) for t in candidates]  # None: plain generate
    for config in configs[1:]:
        session.model.selfspec.config = config
        generate_once(session.model, session.prompts[0], session.spec.measure.warmup_new_tokens or 2, plain=False,
                      measure=session.spec.measure)
    totals = [[0, 0.0] for _ in configs]
    turn = 0
    for _ in range(rounds):
        for ids in session.prompts:
            for j in [(turn + i) % len(configs) for i in range(len(configs))]:
                if configs[j] is not None:
                    session.model.selfspec.config = configs[j]
                m = time_generation(session.model, [ids], session.spec.measure.max_new_tokens, configs[j] is None,
                                    session.spec.measure)
                totals[j][0] += m.new_tokens
                totals[j][1] += m.seconds
            turn += 1
    plain_tps = totals[0][0] / totals[0][1]
    rows = [{"trial": t.number, "params": dict(t.params), "search_tokens_per_s": t.value,
             "confirmed_tokens_per_s": n / s, "speedup": n / s / plain_tps,
             "acceptance_rate": t.user_attrs.get("acceptance_rate"),
             "mean_accepted_tokens": t.user_attrs.get("mean_accepted_tokens")}
            for t, (n, s) in zip(candidates, totals[1:])]
    rows.sort(key=lambda r: r["confirmed_tokens_per_s"], reverse=True)
    for r in rows:
        log(f"confirm  {describe(r['params']):40s} {r['confirmed_tokens_per_s']:6.2f} tok/s "
            f"(x{r['speedup']:.2f} vs plain {plain_tps:.2f})")
    return rows, plain_tps


def drafting_pays(confirmed: list[dict]) -> bool:
    """Whether the fastest re-timed setting (confirm's rows, fastest first) is at least as fast as plain generate
    timed beside it."""
    return confirmed[0]["speedup"] >= 1.0


@dataclass
class CalibrationResult:
    best: SelfSpecConfig
    best_tokens_per_s: float  # re-timed in the final comparison
    plain_tokens_per_s: float  # plain generate, timed in the same comparison
    study_name: str
    storage: str
    report: dict
    output: str | None = None

    @property
    def speedup(self) -> float:
        return self.best_tokens_per_s / self.plain_tokens_per_s


# --- the whole run -------------------------------------------------------------------------------------------
def default_storage(output: str) -> str:
    return f"sqlite:///{os.path.abspath(os.path.join(output, 'study.db'))}"


def _ensure_wrapped(model) -> None:
    """Wrap with the default config, its exit layer clipped to small models (trials set their own)."""
    if getattr(model, "selfspec", None) is None:
        from ...arch import adapter_for

        layers = adapter_for(model).num_layers
        wrap(model, exit_layer=min(SelfSpecConfig().exit_layer, max(layers - 1, 1)))


def calibrate(model, prompts: list[torch.Tensor], spec: SearchSpec | None = None, *, storage: str | None = None,
              output: str | None = None, study_name: str | None = None, trials: int | None = None,
              timeout: float | None = None, model_name: str | None = None, log=print,
              deadline: float | None = None, cut: str = "") -> CalibrationResult:
    """Search the fastest setting of `model` (wrapped or not; heads already attached) over `prompts` ((1, T) ids
    each). The space is checked before anything runs. Writes config + report into `output` when given."""
    import optuna
    from ...drafters import DRAFTERS

    spec = spec or SearchSpec()
    _ensure_wrapped(model)
    model.selfspec.timed = True  # the cost model reads draft and verify seconds: make them true on a GPU too
    engine = model.selfspec
    base = engine.config
    space = resolve_space(spec, engine.adapter.num_layers, list(engine.heads), DRAFTERS)
    _check_budget(trials, timeout, prompts)
    seeds = check_seeds(spec.search.enqueue, space, spec.space.exit_layer == "auto", log)
    if storage is None:
        if output is None:
            raise ValueError("calibrate needs a storage URL or an output directory for the study.")
        os.makedirs(output, exist_ok=True)
        storage = default_storage(output)
    trials = 20 if trials is None and timeout is None and deadline is None else trials
    identity = {**study_identity(model, model_name), "decoding": spec.measure.decoding, "compile": bool(base.compile)}
    study_name = study_name or _default_study_name(identity)
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    log(f"calibrate: {identity['model_name']} ({identity['num_layers']} layers) on {identity['device']} "
        f"{identity['dtype']}, {spec.measure.decoding}, {len(prompts)} prompts x {spec.measure.max_new_tokens} tokens, "
        f"exit layers {space.exit_layers}, drafters {space.drafters}")
    study = open_study(storage, study_name, identity, spec.search.seed, spec.search.startup_trials)
    session = _prepare_session(model, base, prompts, space, spec, log)
    _set_study_attrs(study, session, spec, space)
    enqueue_fresh(study, seeds, "space_file", "setting(s) of the space file", log)  # first: yours
    enqueue_predicted(study, session.predictor, space, spec.search.enqueue_top, log)
    enqueue_previous(study, base, space, log, sampled=spec.measure.decoding != "greedy")
    if deadline is not None:  # a time budget: the search gets what setup left, less the re-timing's estimate
        left = search_timeout(deadline - time.monotonic(), session.plain.seconds, spec.measure, spec.search,
                              len(kinds(space)))
        timeout = max(1.0, min(timeout or left, left))
        log(f"calibrate: the search gets {timeout:.0f} s of the time budget")
    budget = _Budget(session, trials, timeout)
    callbacks = [budget] + [BalanceKinds(space, budget)] * spec.search.balance_kinds
    try:
        study.optimize(session.objective, timeout=timeout, callbacks=callbacks,
                       catch=(torch.cuda.OutOfMemoryError,) if torch.cuda.is_available() else ())
    finally:
        budget.bar.close()
    return _finish(model, study, session, base, storage, output, identity, log, cut)


def with_mode(base: SelfSpecConfig, chosen: SelfSpecConfig, calibration: dict, sampled: bool) -> SelfSpecConfig:
    """The config a calibration writes: a greedy one's setting at the top, a sampled one's as the `sampling`
    section (the fields where it differs from the greedy ones); the other mode's settings and record stay."""
    metadata = {**base.metadata, CALIBRATION_KEY[sampled]: calibration}
    if not sampled:
        return chosen.replace(sampling=base.sampling, metadata=metadata)
    skip = {"sampling", "metadata"}
    differ = {f: getattr(chosen, f) for f in chosen.__dataclass_fields__
              if f not in skip and getattr(chosen, f) != getattr(base, f)}
    return base.replace(sampling=differ, metadata=metadata)


def _check_budget(trials, timeout, prompts) -> None:
    if trials is not None and trials < 1:
        raise ValueError(f"--trials must be >= 1, got {trials}.")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {timeout}.")
    if not prompts:
        raise ValueError("calibrate needs at least one prompt.")


def _default_study_name(identity: dict) -> str:
    name = Path(str(identity["model_name"])).name or "model"
    heads = "heads" + "-".join(map(str, identity["heads"])) if identity["heads"] else "untrained"
    folded = "-foldedgqa" if identity.get("folded_gqa") else ""
    folded += "-compiled" if identity.get("compile") else ""
    decoding = {**_IMPLIED, **identity}["decoding"]
    # one study per sampling setting: "-sampled-temperature0.7-top-p0.9"; greedy studies keep their old names
    slug = decoding.removeprefix("sample, ").replace(", ", "-").replace(" ", "")
    sampled = "" if decoding == "greedy" else f"-sampled-{slug}"
    return f"{name}-{heads}-{identity['device']}-{identity['dtype'].replace('torch.', '')}{folded}{sampled}"


def _prepare_session(model, base, prompts, space, spec, log) -> Session:
    measure = spec.measure
    # warm-up: first calls are slow
    generate_once(model, prompts[0], max(measure.warmup_new_tokens, 2), plain=True, measure=measure)
    plain = time_generation(model, prompts, measure.max_new_tokens, plain=True, measure=measure)
    log(f"plain generate: {plain.tokens_per_s:.2f} tok/s ({plain.new_tokens} tokens in {plain.seconds:.1f}s)")
    predictor = build_predictor(model, base, prompts, plain.outputs, space, measure, log)
    return Session(model, base, prompts, plain, space, spec, predictor, log)


def _set_study_attrs(study, session: Session, spec: SearchSpec, space: SearchSpace) -> None:
    study.set_user_attr("environment", environment(session.model))
    study.set_user_attr("search_spec", spec.to_dict())
    study.set_user_attr("space", space.to_dict())
    study.set_user_attr("plain_tokens_per_s_at_start", session.plain.tokens_per_s)
    if session.predictor is not None:
        study.set_user_attr("acceptance_profile", session.predictor.profile_summary(space.max_draft_tokens[-1]))


def _finish(model, study, session, base, storage, output, identity, log, cut: str = "") -> CalibrationResult:
    candidates = final_candidates(study, session.spec.search)
    if not candidates:
        raise RuntimeError(f"No trial of study {study.study_name!r} was measured; raise --trials or --timeout.")
    confirmed, plain_tps = confirm(session, candidates, session.spec.search.final_rounds, log)
    winner = confirmed[0]
    pays = drafting_pays(confirmed)
    drafts = pays or not session.spec.search.plain_if_slower
    if not drafts:
        log(f"no setting beat plain generate here (fastest: {describe(winner['params'])}, "
            f"x{winner['speedup']:.2f}): the config drafts nothing (drafter 'none'); per_drafter keeps each "
            f"drafter's best")
    chosen = trial_config(base, winner["params"]).replace(**({} if drafts else {"drafter": "none"}))
    calibration = {"tokens_per_s": winner["confirmed_tokens_per_s"], "plain_tokens_per_s": plain_tps,
                   "speedup": winner["speedup"], "drafting_pays": pays,
                   "study": study.study_name, "trial": winner["trial"],
                   "device": identity["device"], "dtype": identity["dtype"], "decoding": identity["decoding"],
                   "date": time.strftime("%Y-%m-%d"), "environment": environment(model),
                   "per_drafter": best_per_drafter(study, confirmed)}
    if cut:
        calibration["cut_to_budget"] = cut
    sampled = identity["decoding"] != "greedy"
    best = with_mode(base, chosen, calibration, sampled)
    study.set_user_attr("final", {"best": winner, "plain_tokens_per_s": plain_tps})
    report = build_report(study, session, confirmed, plain_tps, chosen)
    if output is not None:
        from ... import __version__

        name = REPORT_NAME + ("_sampled" if sampled else "")
        save_result(model, best, report, output, {"selfspec_version": __version__}, name)
        log(f"wrote {output}/selfspec_config.json and {name}.md/.json")
    model.selfspec.config = best
    log(f"best: {describe(winner['params'])} {winner['confirmed_tokens_per_s']:.2f} tok/s vs plain "
        f"{plain_tps:.2f} (x{winner['speedup']:.2f})")
    return CalibrationResult(best, winner["confirmed_tokens_per_s"], plain_tps, study.study_name, storage, report,
                             output)
