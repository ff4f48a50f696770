"""Tokens a step of early-exit chain settings, per category, from the cost model's replay of the loop: no timing.

    OMP_NUM_THREADS=1 python scripts/replay_chains.py --threads 1 --limit 4 \
        '{"max_draft_tokens": 4}' '{"max_draft_tokens": 4, "copy_draft_tokens": 16}' '{"max_draft_tokens": 8}'

Each argument is a JSON object of chain settings laid over the heads' config (max_draft_tokens,
draft_confidence_threshold, draft_confidence_cumulative, copy_draft_tokens). The plain model answers each prompt
(greedy), one teacher-forced pass measures the head's agreement, confidence and copies at every answer token
(cost_model.measure_acceptance), and cost_model.simulate replays the loop's rules over them for every setting. What
it counts does not depend on the machine or its load: tokens a step (prefill included, as the bench's mean
accepted tokens) and drafts a step. Drafts after a step's first wrong one are the replay's estimate.

"modelled x" prices a step as 1 + draft_cost x drafts + verify_cost x drafts (in units of a plain step) and
divides tokens a step by it: a way to read the counts, not a measurement. The defaults are bfloat16 figures: a
drafted token at E=1 about 0.06 of a step (README, Trained exit heads) and a verify pass of 9 tokens about 1.1x a
1-token one on the AVX512-BF16 EPYC (the brief).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", nargs="+", type=json.loads, help="JSON objects of chain settings")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--heads", default=None, help="heads directory (default: the shipped ones)")
    p.add_argument("--split", default="eval", choices=["eval", "train"], help="train: MT-bench, the calibration's")
    p.add_argument("--limit", type=int, default=4, help="prompts per category")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--draft-cost", type=float, default=0.06, help="a drafted token, in plain steps")
    p.add_argument("--verify-cost", type=float, default=0.0125, help="each verify input past the first")
    return p.parse_args(argv)


def answers(model, tok, prompts, new_tokens: int) -> list:
    """(category, cost_model.Sequence) of each prompt's plain greedy answer."""
    from selfspec.prompts import chat_input_ids
    from selfspec.tools.cost_model import Sequence

    out = []
    for prompt in prompts:
        ids = chat_input_ids(tok, prompt.text).to(model.device)
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        out.append((prompt.category, Sequence(ids, full[0, ids.shape[1]:])))
    return out


def subset(acc, rows: list[int]):
    """The LayerAcceptance of some sequences only."""
    from selfspec.tools.cost_model import LayerAcceptance

    pick = (lambda values: [values[i] for i in rows] if values else [])
    return LayerAcceptance(acc.exit_layer, pick(acc.agree), pick(acc.conf), pick(acc.rank), pick(acc.prob),
                           pick(acc.top), pick(acc.copying))


def replay(acc, eos, config, setting: dict, new_tokens: int):
    from selfspec.drafters.base import ConfidenceRule
    from selfspec.tools.cost_model import simulate

    cfg = config.replace(**setting)
    rule = ConfidenceRule(cfg.draft_confidence_threshold, cfg.draft_confidence_cumulative)
    return simulate(acc, eos, cfg.max_draft_tokens, rule, new_tokens, cfg.copy_draft_tokens)


def cell(counts, args) -> str:
    steps = counts.steps + counts.prefills
    drafts = counts.drafted / max(counts.steps, 1)
    price = 1 + (args.draft_cost + args.verify_cost) * drafts
    return f"{counts.new_tokens / steps:.2f} / {drafts:.2f} / {counts.new_tokens / steps / price:.2f}x"


def profiled(args):
    """(model wrapped with the heads, its config, the acceptance at its exit layer, [(category, Sequence)])."""
    import selfspec
    from selfspec.models import resolve_model
    from selfspec.pretrained import shipped_dir
    from selfspec.prompts import load_prompts
    from selfspec.tools.cost_model import measure_acceptance

    model, tok = resolve_model(args.model, dtype=args.dtype)
    seqs = answers(model.eval(), tok, load_prompts(split=args.split, limit_per_category=args.limit),
                   args.new_tokens)  # before wrapping: plain generate's own answers
    config = selfspec.wrap(model, args.heads or str(shipped_dir(args.model))).selfspec.config
    acc = measure_acceptance(model.selfspec, [s for _, s in seqs], [config.exit_layer])[config.exit_layer]
    return model, config, acc, seqs


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    from selfspec.tools.measure import eos_ids_of

    model, config, acc, seqs = profiled(args)
    stop = set(eos_ids_of(model))
    eos = [[int(t) in stop for t in s.answer.tolist()] for _, s in seqs]
    by_category = defaultdict(list)
    for i, (category, _) in enumerate(seqs):
        by_category[category].append(i)
    groups = sorted(by_category.items()) + [("all", list(range(len(seqs))))]
    print(f"{len(seqs)} {args.split} prompts x {args.new_tokens} tokens, {args.dtype}, exit layer "
          f"{config.exit_layer}, agreement {acc.agreement:.3f}; cells: tokens a step / drafts a step / modelled x "
          f"(draft {args.draft_cost}, verify {args.verify_cost} a token)")
    print("| setting | " + " | ".join(name for name, _ in groups) + " |")
    print("|---" * (len(groups) + 1) + "|")
    for setting in args.settings:
        cells = [cell(replay(subset(acc, rows), [eos[i] for i in rows], config, setting, args.new_tokens), args)
                 for _, rows in groups]
        print(f"| `{json.dumps(setting)}` | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
