"""SmolLM2-135M exit heads (untrained norm + LM head, or --heads DIR), 8 Spec-Bench eval prompts,
greedy; tokens/s of selfspec against plain model.generate measured side by side, prompt by prompt.

    python scripts/measure_untrained.py --exit-layers 8 15 24 --max-new-tokens 64
"""
import argparse
import json
import time

import torch

import selfspec
from selfspec.models import load_default_model
from selfspec.prompts import EVAL_CATEGORIES, chat_input_ids, load_prompts


def timed(model, ids, new):
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--exit-layers", type=int, nargs="+", default=[8, 15, 24])
    p.add_argument("--max-draft-tokens", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--categories", nargs="+", default=list(EVAL_CATEGORIES[:4]))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--heads", default=None, help="directory from save_pretrained: measure its trained heads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    prompts = load_prompts(categories=args.categories, limit_per_category=args.per_category)
    timed(model, chat_input_ids(tok, prompts[0].text), 8)  # warm-up
    rows = {"hf-greedy": [0, 0.0]} | {f"E={e}": [0, 0.0, 0, 0, 0] for e in args.exit_layers}
    for prompt in prompts:
        ids = chat_input_ids(tok, prompt.text)
        ref, sec = timed(model, ids, args.max_new_tokens)
        rows["hf-greedy"][0] += ref.shape[1] - ids.shape[1]
        rows["hf-greedy"][1] += sec
        for e in args.exit_layers:
            selfspec.wrap(model, args.heads, exit_layer=e, max_draft_tokens=args.max_draft_tokens)
            out, sec = timed(model, ids, args.max_new_tokens)
            st = model.selfspec.last_stats
            selfspec.unwrap(model)
            assert torch.equal(out, ref), f"output differs at E={e}"
            r = rows[f"E={e}"]
            r[0] += st.new_tokens; r[1] += sec; r[2] += st.verify_steps; r[3] += st.drafted_tokens
            r[4] += st.accepted_tokens
    base = rows["hf-greedy"][0] / rows["hf-greedy"][1]
    print(f"| method | tokens/s | speed vs generate | mean accepted tokens | acceptance rate | exact |")
    print(f"|---|---|---|---|---|---|")
    print(f"| hf-greedy | {base:.1f} | 1.00x | 1.00 | - | yes |")
    for e in args.exit_layers:
        n, sec, steps, drafted, acc = rows[f"E={e}"]
        print(f"| selfspec E={e} K={args.max_draft_tokens} | {n / sec:.1f} | {n / sec / base:.2f}x | "
              f"{n / steps:.2f} | {acc / max(drafted, 1):.1%} | yes |")
    print(json.dumps({"prompts": len(prompts), "categories": args.categories, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
