"""A calibration sized to a time budget: its setup, trials and final re-timing all inside `--time-budget` seconds.

The search's own `--timeout` bounds the trials only. What comes before them (the second turns' answers, plain
generate's timing, the cost model) and after them (the re-timing of the best settings against plain generate)
grows with the prompts and tokens a trial times, not with the timeout. So a budget first shrinks those, in the
order that costs the ranking least, until setup and re-timing take at most half of it; the search gets what is left
after setup, less the re-timing's estimate.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .space import MeasureSpec, StrategySpec

SETUP_SHARE = 0.5  # at most this share of the budget goes to setup and the final re-timing
MIN_TRIALS = 4  # trials the rest of the budget must hold at the least
DRAFTED = 0.8  # a drafted trial's time per token against plain generate's (pruned and slow trials included)
FLOORS = {"max_new_tokens": 16, "answer_tokens": 32, "max_prompts": 2}


def unit_tokens(m: MeasureSpec) -> int:
    """Tokens one trial generates: every timed turn of every prompt, its warm-up included."""
    return m.max_prompts * len(m.turns) * (m.max_new_tokens + m.warmup_new_tokens)


def retime_tokens(m: MeasureSpec, s: StrategySpec, kinds: int) -> float:
    """Plain-token equivalents of the final re-timing: plain generate and every candidate, every round."""
    return s.final_rounds * unit_tokens(m) * (1 + DRAFTED * (s.final_candidates + kinds * s.final_per_kind))


def overhead_tokens(m: MeasureSpec, s: StrategySpec, kinds: int) -> float:
    """Plain-token equivalents of setup and re-timing: the second turns' answers, plain generate's timing and the
    cost model's profiling (about as long again), and the re-timing."""
    answers = m.max_prompts * m.answer_tokens if 2 in m.turns else 0
    return answers + 2 * unit_tokens(m) + retime_tokens(m, s, kinds)


def _cuts(m: MeasureSpec, s: StrategySpec):
    """The next smaller setting, least harmful first: one re-timing round, no per-kind candidates, fewer tokens
    per prompt and shorter first answers, fewer prompts, fewer candidates, first turns only."""
    if s.final_rounds > 1:
        return m, dataclasses.replace(s, final_rounds=1)
    if s.final_per_kind > 0:
        return m, dataclasses.replace(s, final_per_kind=0)
    if m.max_new_tokens > FLOORS["max_new_tokens"] or (2 in m.turns and m.answer_tokens > FLOORS["answer_tokens"]):
        return dataclasses.replace(m, max_new_tokens=max(FLOORS["max_new_tokens"], m.max_new_tokens // 2),
                                   answer_tokens=max(FLOORS["answer_tokens"], m.answer_tokens // 2)), s
    if m.max_prompts > FLOORS["max_prompts"]:
        return dataclasses.replace(m, max_prompts=m.max_prompts - 1), s
    if s.final_candidates > 1:
        return m, dataclasses.replace(s, final_candidates=s.final_candidates - 1)
    if len(m.turns) > 1:
        return dataclasses.replace(m, turns=[min(m.turns)]), s
    return None


@dataclass
class Fitted:
    measure: MeasureSpec
    strategy: StrategySpec
    cut: str  # what was made smaller, in words ("" when nothing was)


def fit(m: MeasureSpec, s: StrategySpec, seconds: float, per_token: float, kinds: int) -> Fitted:
    """The largest setting (from `m` and `s` down) whose setup and re-timing take at most SETUP_SHARE of `seconds`
    and leave room for MIN_TRIALS trials, at `per_token` seconds per plain token; the smallest when none does."""
    tokens = seconds / max(per_token, 1e-9)
    fm, fs = m, s
    while (overhead_tokens(fm, fs, kinds) > SETUP_SHARE * tokens
           or overhead_tokens(fm, fs, kinds) + MIN_TRIALS * DRAFTED * unit_tokens(fm) > tokens):
        smaller = _cuts(fm, fs)
        if smaller is None:
            break
        fm, fs = smaller
    return Fitted(fm, fs, describe_cut(m, s, fm, fs))


def describe_cut(m: MeasureSpec, s: StrategySpec, fm: MeasureSpec, fs: StrategySpec) -> str:
    parts = [f"{label} {getattr(new, key)} (of {getattr(old, key)})"
             for label, key, old, new in (("prompts", "max_prompts", m, fm),
                                          ("tokens a prompt", "max_new_tokens", m, fm),
                                          ("first-answer tokens", "answer_tokens", m, fm),
                                          ("re-timing rounds", "final_rounds", s, fs),
                                          ("re-timed candidates", "final_candidates", s, fs),
                                          ("re-timed per kind", "final_per_kind", s, fs))
             if getattr(old, key) != getattr(new, key)]
    if fm.turns != m.turns:
        parts.append(f"turns {fm.turns} (of {m.turns})")
    return ", ".join(parts)


def search_timeout(seconds_left: float, plain_seconds: float, m: MeasureSpec, s: StrategySpec, kinds: int) -> float:
    """Seconds the search may take once setup is done: what is left, less the re-timing (scaled from plain
    generate's measured time for one pass over the prompts) and one trial in flight when the timeout strikes."""
    per_unit = plain_seconds  # plain generate over every timed prompt: one unit
    retime = per_unit * retime_tokens(m, s, kinds) / max(unit_tokens(m), 1)
    return seconds_left - retime - DRAFTED * per_unit
