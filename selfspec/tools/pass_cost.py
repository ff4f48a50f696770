"""Cost of one T-token forward pass relative to a 1-token pass, per dtype: the number that decides whether
speculative decoding can pay on a device (a verify pass over K+1 tokens must cost about one decoding step).

    OMP_NUM_THREADS=1 python -m selfspec.tools.pass_cost --threads 1
    python -m selfspec.tools.pass_cost --dtypes float32 bfloat16 --tokens 1 3 5 7 9 --cache 200 --repeats 12

Plain transformers, no selfspec: the embedded SmolLM2 (or --model) with a DynamicCache holding `--cache` tokens;
each timed pass appends T tokens and is cropped back, so every pass sees the same cache. Passes of every
(dtype, T) are interleaved repeat by repeat so that load drifting on a shared machine hits them alike; the
table shows the median time of the 1-token pass and the median of each T-token pass divided by it.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="short name, local HF directory or hub id")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   help="dtypes to compare")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 3, 5, 7, 9], help="pass sizes T (1 is the unit)")
    p.add_argument("--cache", type=int, default=200, help="tokens already in the KV cache")
    p.add_argument("--repeats", type=int, default=12, help="interleaved repeats per (dtype, T); median reported")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    return p.parse_args(argv)


def random_ids(model, length: int, device) -> torch.Tensor:
    """(1, length) token ids above the special tokens at the vocabulary's start."""
    vocab = model.config.vocab_size
    return torch.randint(min(100, vocab // 2), vocab, (1, length), device=device)


def prefilled_cache(model, length: int, device):
    """A DynamicCache holding `length` random tokens, and the position after them."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = random_ids(model, length, device)
    model(ids, cache=cache, use_cache=True)
    return cache


def time_pass(model, cache, t: int, device) -> float:
    """Seconds of one forward over t new tokens on top of `cache`, which is cropped back afterwards."""
    length = cache.get_seq_length()
    ids = random_ids(model, t, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    model(ids, cache=cache, use_cache=True, logits_to_keep=t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    cache.crop(-t)  # transformers 5: crop takes the number of tokens to remove, negative
    assert cache.get_seq_length() == length
    return seconds


@torch.no_grad()
def measure(args) -> dict:
    from selfspec.models import resolve_model

    device = torch.device(args.device)
    runs = {}
    for name in args.dtypes:
        model, _ = resolve_model(args.model, dtype=name, device=device)
        runs[name] = (model, prefilled_cache(model, args.cache, device))
        for t in args.tokens:  # warm-up: first calls allocate and pick kernels
            time_pass(model, runs[name][1], t, device)
    times = {(name, t): [] for name in args.dtypes for t in args.tokens}
    for _ in range(args.repeats):
        for name in args.dtypes:
            model, cache = runs[name]
            for t in args.tokens:
                times[name, t].append(time_pass(model, cache, t, device))
    return {key: statistics.median(v) for key, v in times.items()}


def table(medians: dict, dtypes, tokens) -> str:
    head = "| dtype | 1-token pass | " + " | ".join(f"T={t}" for t in tokens if t != 1) + " |"
    lines = [head, "|---" * (len(tokens) + 1) + "|"]
    for name in dtypes:
        cells = [f"{medians[name, t] / medians[name, 1]:.2f}x" for t in tokens if t != 1]
        lines.append(f"| {name} | {medians[name, 1] * 1e3:.1f} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = sorted(set(args.tokens) | {1})
    args.tokens = tokens
    medians = measure(args)
    print(f"{args.model}, cache {args.cache} tokens, {torch.get_num_threads()} thread(s), median of {args.repeats}")
    print(table(medians, args.dtypes, tokens))


if __name__ == "__main__":
    main()
