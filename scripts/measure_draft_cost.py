"""Cost of one drafted token at each exit layer and head design, relative to a plain decoding step, with the
cost model's own micro-timings (selfspec.tools.cost_model.measure_timings: the engine's split forward on a
prefilled cache, fastest of repeats).

    OMP_NUM_THREADS=1 python scripts/measure_draft_cost.py --threads 1 --untrained 1 2 4 8 15 \
        --design mlp=selfspec/assets/smollm2-135m

One drafted token = the embedding, layers [0, E) on one token and the head (with its softmax and argmax); a plain
step = the embedding, all L layers on one token and the LM head. An attention head is timed on the token alone
(its KV context costs little more at these lengths).
"""
from __future__ import annotations

import argparse

import torch

import selfspec
from selfspec.heads import ExitHead
from selfspec.io import load_heads
from selfspec.tools import cost_model


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--design", action="append", default=[], metavar="NAME=DIR",
                   help="heads saved by save_pretrained or train_heads; every head in DIR is timed")
    p.add_argument("--untrained", type=int, nargs="*", default=[], help="exit layers timed with the plain exit")
    p.add_argument("--repeats", type=int, default=7, help="repeats per micro-timing (fastest taken)")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def draft_cost(engine, head: ExitHead, prompt: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(seconds per drafted token with `head`, seconds per plain step), from one set of timings."""
    engine.add_head(head)
    t = cost_model.measure_timings(engine, [prompt], [head.exit_layer], 1, repeats)
    draft = t.embed + t.layers(head.exit_layer, 1) + t.head[head.exit_layer]
    plain = t.embed + t.layers(t.num_layers, 1) + t.lm_head[1]
    return draft, plain


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = selfspec.load(args.model)
    engine = model.selfspec
    prompt = tok("Explain how a hash map works, with a short example in Python.", return_tensors="pt").input_ids
    heads = [("untrained", ExitHead(e)) for e in args.untrained]
    for spec in args.design:
        name, directory = spec.split("=", 1)
        heads += [(name, h) for h in load_heads(directory, engine.adapter)]
    print("| design | exit | kind | draft vocabulary | one drafted token | plain step | draft / step |")
    print("|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name, head in heads:
            draft, plain = draft_cost(engine, head, prompt, args.repeats)
            vocab = "full" if head.vocab_ids is None else str(head.vocab_ids.numel())
            print(f"| {name} | {head.exit_layer} | {type(head).__name__} | {vocab} | {1000 * draft:.2f} ms | "
                  f"{1000 * plain:.2f} ms | {draft / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()
