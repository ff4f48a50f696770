"""Does the draft vocabulary cap a trained head? First-draft agreement scored three ways.

A head scores only its `vocab_ids` (the most frequent training tokens), so a next token outside them can never be
drafted. This script takes the plain greedy answers of a `selfspec bench` run (hf-greedy's outputs in its
results.json), runs the model teacher-forced over prompt + answer once, and asks the head for each answer token
(as a step's first draft does: layer-E state of the token before, final state of the one before that) with its
argmax over
  - static:  its own vocab_ids (what it drafts today),
  - context: vocab_ids plus every token of the prompt and the answer so far (copied names and numbers),
  - full:    the whole vocabulary.
It also reports how many answer tokens each set holds (the ceiling on agreement). Run:

    OMP_NUM_THREADS=1 python scripts/measure_draft_vocab.py \
        --results bench_results/smollm2-135m-bf16-fallback/results.json --threads 1
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", required=True, help="results.json of a selfspec bench run that ran hf-greedy")
    p.add_argument("--heads", default="selfspec/assets/smollm2-135m", help="directory with the trained head")
    p.add_argument("--exit-layer", type=int, default=2)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def answers(results_path: str):
    """(category, question_id, answer tokens) of every hf-greedy row of a bench run."""
    records = json.load(open(results_path))["records"]
    for rec in records:
        if rec["method"] == "hf-greedy":
            for qid, row in zip(rec["question_ids"], rec["outputs"]):
                yield rec["category"], qid, row


@torch.no_grad()
def first_draft_logits(model, head, adapter, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """(n, V) full-vocabulary logits of the head's first draft for each of the n answer tokens."""
    from selfspec.heads import previous_top

    states = model(torch.tensor([prompt + answer]), output_hidden_states=True).hidden_states
    early, top = states[head.exit_layer], states[-1]  # (1, T, H): input of layer E; final-normed states
    prev = previous_top(top) if head.reads_top else None
    normed = head.normed(early, adapter, prev)[0]  # (T, H)
    p, n = len(prompt), len(answer)
    return adapter.logits(normed[p - 1 : p - 1 + n][None])[0].float()  # state at p-1+i drafts answer token i


def allowed_sets(vocab: int, static: torch.Tensor, prompt: list[int], answer: list[int]) -> dict:
    """name -> (n, V) bool: the tokens each scoring may choose from, per answer position."""
    n = len(answer)
    fixed = torch.zeros(vocab, dtype=torch.bool)
    fixed[static] = True
    seen = torch.zeros(n, vocab, dtype=torch.bool)
    text = torch.tensor(prompt + answer)
    for i in range(n):
        seen[i, text[: len(prompt) + i]] = True
    return {"static": fixed.expand(n, vocab), "context": seen | fixed, "full": torch.ones(n, vocab, dtype=torch.bool)}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    import selfspec
    from selfspec.models import resolve_model
    from selfspec.prompts import load_prompts
    from selfspec.tools.bench import encode

    model, tok = resolve_model(args.model, dtype=args.dtype)
    model.eval()
    adapter = selfspec.arch.adapter_for(model)
    selfspec.wrap(model, args.heads)
    head = model.selfspec.head_for(args.exit_layer)
    selfspec.unwrap(model)
    if head.vocab_ids is None:
        raise SystemExit(f"The head at layer {args.exit_layer} in {args.heads} scores the full vocabulary already.")
    prompts = {p.question_id: p for p in load_prompts(split="all")}
    tally = defaultdict(lambda: defaultdict(int))  # category -> counter
    for category, qid, answer in answers(args.results):
        prompt = encode(tok, prompts[qid], True)
        logits = first_draft_logits(model, head, adapter, prompt, answer)
        want = torch.tensor(answer)
        t = tally[category]
        t["tokens"] += len(answer)
        for name, allowed in allowed_sets(logits.shape[-1], head.vocab_ids, prompt, answer).items():
            t[f"{name} holds"] += int(allowed[torch.arange(len(answer)), want].sum())
            t[f"{name} agrees"] += int((logits.masked_fill(~allowed, float("-inf")).argmax(-1) == want).sum())
    tally["all"] = {k: sum(t[k] for t in list(tally.values())) for k in next(iter(tally.values()))}
    print("| category | answer tokens | in static vocab | in static + context | agreement: static | static + "
          "context | full vocabulary |")
    print("|---|---|---|---|---|---|---|")
    for category, t in tally.items():
        n = t["tokens"]
        print(f"| {category} | {n} | {t['static holds'] / n:.1%} | {t['context holds'] / n:.1%} | "
              f"{t['static agrees'] / n:.1%} | {t['context agrees'] / n:.1%} | {t['full agrees'] / n:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
