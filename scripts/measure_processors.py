"""What Hugging Face's sampling warpers cost per row of logits, the work verification repeats at every position it
reads (plain `generate` does it once per token).

    OMP_NUM_THREADS=1 python scripts/measure_processors.py --threads 1
    python scripts/measure_processors.py --vocab 49152 --rows 1 3 9 --device cuda

Times temperature alone, temperature + top-k, and temperature + top-p over random (rows, vocab) float32 logits, the
median of --repeats calls after a warm-up, and prints a markdown table of milliseconds per call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers.generation import logits_process as lp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=49152, help="row width (default: SmolLM2's vocabulary)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 3, 9])
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def warper_sets(args) -> dict[str, lp.LogitsProcessorList]:
    temperature = lp.TemperatureLogitsWarper(args.temperature)
    return {
        f"temperature {args.temperature}": lp.LogitsProcessorList([temperature]),
        f"+ top-k {args.top_k}": lp.LogitsProcessorList([temperature, lp.TopKLogitsWarper(args.top_k)]),
        f"+ top-p {args.top_p}": lp.LogitsProcessorList([temperature, lp.TopPLogitsWarper(args.top_p)]),
    }


def median_ms(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@torch.no_grad()
def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    sets = warper_sets(args)
    print(f"ms per call over (rows, {args.vocab}) float32 logits on {device}, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeats}")
    print("| warpers | " + " | ".join(f"{r} row(s)" for r in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for name, processors in sets.items():
        cells = []
        for rows in args.rows:
            logits = (3 * torch.randn(rows, args.vocab, generator=generator)).to(device)
            ids = torch.zeros(rows, 1, dtype=torch.long, device=device)  # these warpers never read the prefix
            cells.append(f"{median_ms(lambda: processors(ids, logits.clone()), args.repeats, device):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
