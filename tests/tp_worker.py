"""One rank of a tensor-parallel test job, launched by tests/test_tensor_parallel.py through torchrun:

    python -m torch.distributed.run --nproc-per-node 2 --master-port P tests/tp_worker.py \
        --model DIR --out DIR [--heads DIR --reference FILE] --checks greedy,sample,heads,diverge

Loads the model with transformers' tensor-parallel plan (weights as DTensors, gloo on CPU), runs the checks and
writes what it saw to OUT/rank{R}.json; the parent test compares the ranks with each other and with what a
single process computed. A check that raises is recorded (type and message), not propagated, so that a
divergence the engine detects can be asserted on.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import traceback

import torch
import torch.distributed as dist

GEN = dict(pad_token_id=0)


def load(path: str, dtype: torch.dtype):
    import transformers as tf
    from transformers import DistributedConfig

    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                    distributed_config=DistributedConfig(tp_plan="auto"))
    return model.eval()


def tiny_inputs():
    from conftest import padded_batch, prompt

    return [(prompt(seed=1), None), padded_batch(seed=2)]


def generate(model, ids, mask, **kw):
    return model.generate(ids, attention_mask=mask, **{**GEN, **kw})


def check_greedy(model, inputs, settings) -> dict:
    """Wrapped greedy generate against the same tensor-parallel model's plain generate, on this rank."""
    import selfspec

    out = {"equal": [], "tokens": [], "mean_accepted": []}
    for ids, mask in inputs:
        ref = generate(model, ids, mask, max_new_tokens=20, do_sample=False)
        for cfg in settings:
            selfspec.wrap(model, **cfg)
            try:
                got = generate(model, ids, mask, max_new_tokens=20, do_sample=False)
                out["mean_accepted"].append(model.selfspec.last_stats.mean_accepted_tokens)
            finally:
                selfspec.unwrap(model)
            out["equal"].append(bool(torch.equal(got, ref)))
            out["tokens"].append(got.tolist())
    return out


def check_sample(model, inputs) -> dict:
    """Sampled generations with one seed on every rank: each rank reports its tokens, the parent compares."""
    import selfspec

    torch.manual_seed(1234)
    out = {"tokens": [], "steps": 0}
    for cfg, kw in (({"exit_layer": 2, "max_draft_tokens": 3}, {"temperature": 1.0}),
                    ({"exit_layer": 1, "max_draft_tokens": 5}, {"temperature": 0.7, "top_k": 20}),
                    ({"exit_layer": 3, "max_draft_tokens": 2, "drafter": "ngram"}, {"top_p": 0.9})):
        selfspec.wrap(model, **cfg)
        try:
            for ids, mask in inputs:
                got = generate(model, ids, mask, max_new_tokens=32, do_sample=True, **kw)
                out["tokens"].append(got.tolist())
                out["steps"] += model.selfspec.last_stats.verify_steps
        finally:
            selfspec.unwrap(model)
    return out


def check_heads(model, inputs, heads_dir: str, reference: str, out_dir: str, rank: int) -> dict:
    """Heads saved by one process load on every rank and compute what they computed there; greedy stays exact;
    saving from every rank writes the single process's model fingerprint."""
    import selfspec

    ref = torch.load(reference)
    selfspec.wrap(model, heads_dir)
    try:
        engine = model.selfspec
        hidden = ref["hidden"]
        with torch.no_grad():
            diffs = {str(e): float((engine.heads[e](hidden, engine.adapter) - ref["logits"][e]).abs().max())
                     for e in sorted(engine.heads)}
        engine.save_pretrained(os.path.join(out_dir, f"saved_rank{rank}"))
    finally:
        selfspec.unwrap(model)
    greedy = check_greedy(model, inputs, [{"config": heads_dir, "exit_layer": e, "max_draft_tokens": 4}
                                          for e in sorted(ref["logits"])])
    return {"max_abs_diff": diffs, **greedy}


def check_diverge(model, inputs, rank: int) -> dict:
    """Planted divergences must raise on every rank; with the agreement switched off they are silent."""
    import selfspec
    import selfspec.decoding
    import selfspec.distributed

    out = {}
    ids, mask = inputs[-1]
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=3)
    try:
        torch.manual_seed(100 + rank)  # the bug: ranks seeded differently
        out["seeded_differently"] = _error_of(lambda: generate(model, ids, mask, max_new_tokens=32, do_sample=True))

        plain = selfspec.decoding.verify_greedy
        calls = []

        def perturbed(draft, logits, draft_len):  # the bug: rank 1 changes its token at decode step 3
            n, token = plain(draft, logits, draft_len)
            calls.append(1)
            return (n, token + 1) if rank == 1 and len(calls) == 3 else (n, token)

        selfspec.decoding.verify_greedy = perturbed
        try:
            out["perturbed_token"] = _error_of(lambda: generate(model, ids, mask, max_new_tokens=20, do_sample=False))
        finally:
            selfspec.decoding.verify_greedy = plain
    finally:
        selfspec.unwrap(model)
    # the check itself, called directly: drafts beyond the accepted ones may differ, accepted ones may not
    from selfspec.distributed import agree_across_ranks

    n, token = torch.tensor([2, 1]), torch.tensor([7, 9])
    drafts = torch.tensor([[5, 6, 30 + rank], [4, 40 + rank, 8]])  # rank-dependent only after each row's n
    out["rejected_drafts_differ"] = _error_of(lambda: agree_across_ranks(n, token, drafts, step=5))
    drafts[1, 0] += rank
    out["accepted_drafts_differ"] = _error_of(lambda: agree_across_ranks(n, token, drafts, step=5))
    # negative control: without agreement, differently seeded ranks decode different text and nothing says so.
    # One token per step (no drafts) and EOS held off, so every rank runs the same collectives and cannot hang.
    selfspec.wrap(model, drafter="none")
    selfspec.distributed.set_group(None)
    try:
        torch.manual_seed(100 + rank)
        got = generate(model, ids, mask, max_new_tokens=16, min_new_tokens=16, do_sample=True)
        out["unchecked_tokens"] = got.tolist()
    finally:
        selfspec.distributed.set_group(selfspec.distributed.WORLD)
        selfspec.unwrap(model)
    return out


def check_smollm2(model, path: str, heads_dir: str) -> dict:
    """SmolLM2 with its shipped heads and calibrated config: greedy identity on chat prompts; a sampled run."""
    import transformers as tf

    import selfspec
    from selfspec.prompts import chat_input_ids

    tok = tf.AutoTokenizer.from_pretrained(path)
    out = {"equal": [], "tokens": [], "stats": []}
    prompts = ["Name three prime numbers.", "Translate 'good morning' into French and German."]
    refs = [model.generate(chat_input_ids(tok, p), max_new_tokens=24, do_sample=False) for p in prompts]
    selfspec.wrap(model, heads_dir)
    try:
        for p, ref in zip(prompts, refs):
            got = model.generate(chat_input_ids(tok, p), max_new_tokens=24, do_sample=False)
            out["equal"].append(bool(torch.equal(got, ref)))
            out["tokens"].append(got.tolist())
            out["stats"].append(model.selfspec.last_stats.to_dict())
        torch.manual_seed(7)
        got = model.generate(chat_input_ids(tok, prompts[0]), max_new_tokens=16, do_sample=True)
        out["sampled"] = got.tolist()
    finally:
        selfspec.unwrap(model)
    return out


def _error_of(fn) -> dict | None:
    try:
        fn()
    except Exception as err:  # recorded for the parent, which asserts on it
        return {"type": type(err).__name__, "message": str(err)}
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--checks", default="greedy,sample")
    p.add_argument("--heads")
    p.add_argument("--reference")
    p.add_argument("--dtype", default="float64")
    args = p.parse_args()
    torch.set_num_threads(1)
    # our own process group, with a timeout, so that a collective one rank never reaches fails instead of hanging
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    model = load(args.model, getattr(torch, args.dtype))
    report = {"rank": rank, "world": dist.get_world_size(),
              "lm_head_is_dtensor": type(model.get_output_embeddings().weight).__name__ == "DTensor"}
    inputs = None if "smollm2" in args.checks else tiny_inputs()
    for check in args.checks.split(","):
        try:
            if check == "greedy":
                report[check] = check_greedy(model, inputs, [{"exit_layer": 1, "max_draft_tokens": 3},
                                                             {"exit_layer": 2, "max_draft_tokens": 1},
                                                             {"exit_layer": 3, "max_draft_tokens": 8}])
            elif check == "sample":
                report[check] = check_sample(model, inputs)
            elif check == "heads":
                report[check] = check_heads(model, inputs, args.heads, args.reference, args.out, rank)
            elif check == "diverge":
                report[check] = check_diverge(model, inputs, rank)
            elif check == "smollm2":
                report[check] = check_smollm2(model, args.model, args.heads)
            else:
                raise ValueError(f"unknown check {check!r}")
        except Exception:
            report[check] = {"error": traceback.format_exc()}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(report, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
