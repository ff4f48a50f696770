"""What a trial runs: the calibration prompts, and generation (greedy, or sampled as measure.sample says) timed with
device synchronisation (plain `generate` or the wrapped model at a trial's setting)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ...config import SelfSpecConfig
from ...prompts import EVAL_CATEGORIES, Prompt, chat_input_ids, conversation_ids, load_prompts
from ..measure import eos_ids_of, sampling_kwargs, timed
from ..verdict import DIFFERS, IDENTICAL, NEAR_TIE, PlainLogits, judge
from .space import MeasureSpec


# --- calibration prompts -------------------------------------------------------------------------------------
def load_calibration_prompts(path: str | None, count: int) -> list[Prompt]:
    """Questions to calibrate on, with all their turns: Spec-Bench's train split (its MT-bench categories) by
    default, or the user's JSONL (Spec-Bench format) / text file. Evaluation categories are dropped from any file:
    never calibrate on what the benchmarks report."""
    if path is None:
        prompts = load_prompts(split="train")
    else:
        prompts = load_prompts(path, split="all")
        kept = [p for p in prompts if p.category not in EVAL_CATEGORIES]
        if len(kept) < len(prompts):
            print(f"calibrate: dropped {len(prompts) - len(kept)} prompts of Spec-Bench's evaluation categories "
                  f"{EVAL_CATEGORIES}.", file=sys.stderr)
        if not kept:
            raise ValueError(f"{path} holds no calibration prompts outside the evaluation categories.")
        prompts = kept
    return pick_prompts([(p.category, p) for p in prompts], count)


def load_calibration_texts(path: str | None, count: int) -> list[str]:
    """The first user turns of load_calibration_prompts."""
    return [p.text for p in load_calibration_prompts(path, count)]


def pick_prompts(prompts: list[tuple[str, object]], count: int) -> list:
    """Round-robin over categories in file order, so a few prompts still cover every category: (category, item)
    pairs -> the items picked."""
    by_category: dict[str, list] = {}
    for category, item in prompts:
        by_category.setdefault(category, []).append(item)
    picked, depth = [], 0
    while len(picked) < count and any(depth < len(v) for v in by_category.values()):
        picked += [v[depth] for v in by_category.values() if depth < len(v)]
        depth += 1
    return picked[:count]


def encode_prompts(tokenizer, texts: list[str], device) -> list[torch.Tensor]:
    """(1, T) ids per prompt: the chat template with a generation prompt when the tokenizer has one."""
    return [chat_input_ids(tokenizer, text).to(device) for text in texts]


def encode_turns(model, tokenizer, prompts: list[Prompt], measure: MeasureSpec, device, log=print
                 ) -> list[torch.Tensor]:
    """(1, T) ids of every turn in measure.turns of every prompt, turn by turn: turn 1 is the first user turn;
    turn 2 the conversation after the model's own greedy answer to it (plain `generate`, measure.answer_tokens
    long) and then the second user turn, as Spec-Bench runs MT-bench. A second turn quotes and reworks the first
    answer, which is where drafting by lookup pays, so a calibration on first turns alone cannot tell apart
    settings that differ there. Prompts without a second turn (a text file) give turn 1 only, and when no prompt
    has one the calibration times the first turns, saying so in one line through `log`."""
    firsts = encode_prompts(tokenizer, [p.text for p in prompts], device)
    two = [(p, ids) for p, ids in zip(prompts, firsts) if len(p.turns) > 1] if 2 in measure.turns else []
    if 2 in measure.turns and not two:
        log("calibrating on first turns: no calibration prompt has a second turn (measure.turns asks for "
            f"{' and '.join(map(str, measure.turns))})")
        return list(firsts)
    out = list(firsts) if 1 in measure.turns else []
    return out + [second_turn_ids(model, tokenizer, p, ids, measure.answer_tokens).to(device) for p, ids in two]


def second_turn_ids(model, tokenizer, prompt: Prompt, first: torch.Tensor, answer_tokens: int) -> torch.Tensor:
    """(1, T) ids of [first user turn, the model's own greedy answer to it, second user turn]."""
    answer = generate_once(model, first, answer_tokens, plain=True)
    messages = [{"role": "user", "content": prompt.turns[0]},
                {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": prompt.turns[1]}]
    return conversation_ids(tokenizer, messages)


# --- timed generation ----------------------------------------------------------------------------------------
@dataclass
class Measurement:
    tokens_per_s: float
    new_tokens: int
    seconds: float
    outputs: list[torch.Tensor]  # generated ids (N,) per prompt
    stats: dict = field(default_factory=dict)  # summed GenerationStats fields (speculative runs only)


GREEDY = MeasureSpec()


def generate_once(model, ids: torch.Tensor, new_tokens: int, plain: bool, measure: MeasureSpec = GREEDY
                  ) -> torch.Tensor:
    """One generate call, greedy or sampled as `measure` says; sampled from measure.seed, so that every setting and
    plain generate draw alike."""
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=measure.sample,
                  pad_token_id=pad_id_of(model))
    if measure.sample:
        kwargs.update(sampling_kwargs(measure.temperature, measure.top_p))
        torch.manual_seed(measure.seed)
    # the class's generate is Hugging Face's own; the instance attribute is the wrapped one
    generate = type(model).generate.__get__(model) if plain else model.generate
    return generate(ids, **kwargs)[0, ids.shape[1]:]


def pad_id_of(model) -> int:
    """The generation config's pad id, else its first EOS id (as Hugging Face's generate pads), else 0."""
    pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else next(iter(eos_ids_of(model)), 0)


_STAT_KEYS = ("new_tokens", "verify_steps", "drafted_tokens", "accepted_tokens", "draft_seconds", "verify_seconds",
              "prefill_seconds")


@torch.no_grad()
def time_generation(model, prompts: list[torch.Tensor], new_tokens: int, plain: bool,
                    measure: MeasureSpec = GREEDY) -> Measurement:
    """Generation of every prompt (greedy, or sampled as `measure` says), timed with device synchronisation; stats
    summed over prompts."""
    device = prompts[0].device
    outputs, seconds, totals = [], 0.0, dict.fromkeys(_STAT_KEYS, 0)
    for ids in prompts:
        out, took = timed(lambda: generate_once(model, ids, new_tokens, plain, measure), device, model)
        seconds += took
        outputs.append(out.cpu())
        if not plain:
            stats = model.selfspec.last_stats
            for key in _STAT_KEYS:
                totals[key] += getattr(stats, key)
    total = sum(o.numel() for o in outputs)
    if not plain:
        totals["acceptance_rate"] = totals["accepted_tokens"] / max(totals["drafted_tokens"], 1)
        totals["mean_accepted_tokens"] = totals["new_tokens"] / max(totals["verify_steps"], 1)
    return Measurement(total / seconds if seconds else 0.0, total, seconds, outputs, {} if plain else totals)


def time_setting(model, config: SelfSpecConfig, prompts, measure: MeasureSpec) -> Measurement:
    """Switch the engine to `config`, warm it up untimed, then time it."""
    model.selfspec.config = config  # validated there
    if measure.warmup_new_tokens:
        generate_once(model, prompts[0], measure.warmup_new_tokens, plain=False, measure=measure)
    return time_generation(model, prompts, measure.max_new_tokens, plain=False, measure=measure)


# --- exactness -------------------------------------------------------------------------------------------------
def exactness(model, plain: PlainLogits, prompts: list[torch.Tensor], outputs: list[torch.Tensor],
              want: list[torch.Tensor], chunk: int) -> dict:
    """Counts of prompts whose greedy output is identical to plain generate's (`want`), parts from it at a
    near-tie of the plain model (half precision: tools.verdict), or differs (a bug). A float32 difference is
    judged by the same rule, where the model's rounding leaves no room for a near-tie."""
    counts = {IDENTICAL: 0, NEAR_TIE: 0, DIFFERS: 0}
    for ids, got, ref in zip(prompts, outputs, want):
        if torch.equal(got, ref):
            counts[IDENTICAL] += 1
            continue
        verdict = judge(model, plain, ids[0].tolist(), got.tolist(), ref.tolist(), len(ref), chunk=chunk)
        counts[verdict.kind] += 1
    return counts
