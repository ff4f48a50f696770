"""`selfspec generate`: stream an answer from a wrapped model, then one line of speed stats."""
from __future__ import annotations

import argparse
import sys
import time

EXAMPLE = """examples:
  selfspec generate "Explain speculative decoding in two sentences."
  selfspec generate --chat --max-new-tokens 64 --sample --temperature 0.7 "Write a haiku about caches."
  selfspec generate --model ./my-llama --heads ./my-heads --exit-layer 10 "Hello"
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="selfspec generate", description="Generate text with self-speculative decoding and print speed stats.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt (use --chat to apply the chat template)")
    p.add_argument("--model", default="smollm2-135m",
                   help="embedded model name, local HF model directory or hub id (default: smollm2-135m)")
    p.add_argument("--heads", default=None, help="directory written by model.selfspec.save_pretrained")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default: 128)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold (with --sample)")
    p.add_argument("--exit-layer", type=int, default=None, help="override the exit layer")
    p.add_argument("--max-draft-tokens", type=int, default=None, help="override the draft length K")
    p.add_argument("--drafter", default=None, help="early_exit, ngram, hybrid or none")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model precision; auto = the checkpoint's dtype, or for the embedded model bfloat16 where "
                        "the CPU/GPU computes it in hardware, else float32 (default: auto)")
    p.add_argument("--seed", type=int, default=0, help="random seed for --sample (default: 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from transformers import TextStreamer

    from . import from_pretrained
    from .prompts import chat_input_ids

    overrides = {k: v for k, v in (("exit_layer", args.exit_layer), ("max_draft_tokens", args.max_draft_tokens),
                                   ("drafter", args.drafter)) if v is not None}
    model, tok = from_pretrained(args.model, heads=args.heads, dtype=args.dtype, **overrides)
    if args.chat:
        ids = chat_input_ids(tok, args.prompt)
    else:
        ids = tok(args.prompt, return_tensors="pt")["input_ids"]
    ids = ids.to(model.device)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        torch.manual_seed(args.seed)
        gen.update(temperature=args.temperature, top_p=args.top_p)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), streamer=TextStreamer(tok, skip_prompt=True), **gen)
    seconds = time.perf_counter() - start
    st = model.selfspec.last_stats
    cfg = model.selfspec.config
    print(f"\n[selfspec] {st.new_tokens} tokens in {seconds:.2f}s = {st.new_tokens / seconds:.1f} tok/s | "
          f"mean accepted tokens {st.mean_accepted_tokens:.2f} | acceptance rate {st.acceptance_rate:.1%} | "
          f"drafter {cfg.drafter}, exit layer {cfg.exit_layer}, K={cfg.max_draft_tokens}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
