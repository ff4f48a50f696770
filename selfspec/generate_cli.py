"""`selfspec generate`: stream an answer from a wrapped model, then one line of speed stats.

Only argparse is imported at module level: `selfspec generate --help` answers without importing torch."""
from __future__ import annotations

import argparse
import sys
import time

# Drafters the command line can build from a name alone ("model" needs a second model object, "oracle" the
# true continuation; both exist only in Python): the registry's searchable ones (drafters/registry.py), named here
# so that --help imports no torch; tests/test_cli.py holds the two equal.
CLI_DRAFTERS = ("early_exit", "ngram", "hybrid", "none")
DTYPES = ("auto", "bfloat16", "float16", "float32")  # selfspec.models.DTYPE_CHOICES, without importing torch

EXAMPLE = """examples:
  selfspec generate "Explain speculative decoding in two sentences."
  selfspec generate --compare "Explain speculative decoding in two sentences."   # also time plain generate
  selfspec generate --temperature 0.7 --max-new-tokens 64 "Write a haiku about caches."   # samples
  selfspec generate --no-chat "The three laws of motion are"                      # raw continuation
  selfspec generate --model ./my-llama --heads ./my-heads --exit-layer 10 "Hello"

threads: on a CPU shared with other jobs use --threads 1 (or as many as there are idle cores); torch's default
of one thread per core slows down sharply when the cores are busy. Errors print one line; --debug shows the
traceback.
"""


class _OneLineErrors(argparse.ArgumentParser):
    """Bad flags print one line (not the whole usage) and exit with status 2, as argparse does."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineErrors(
        prog="selfspec generate", description="Generate text with self-speculative decoding and print speed stats.",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt: a user message for an instruct model, else text to continue")
    p.add_argument("--model", default="smollm2-135m",
                   help="embedded model name, local HF model directory or hub id owner/name (default: smollm2-135m)")
    p.add_argument("--heads", default=None, help="directory written by model.selfspec.save_pretrained")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template to the prompt (default: yes when the tokenizer has "
                        "one, as instruct models do); --no-chat continues the raw text")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate (default: 128)")
    p.add_argument("--sample", action="store_true",
                   help="sample instead of greedy decoding (implied by --temperature or --top-p)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature > 0; giving it turns on --sample (default with --sample: 1.0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling threshold in (0, 1]; giving it turns on --sample")
    p.add_argument("--exit-layer", type=int, default=None, help="override the exit layer E (1 <= E < layers)")
    p.add_argument("--max-draft-tokens", type=int, default=None, help="override the draft length K (>= 1)")
    p.add_argument("--drafter", default=None, choices=CLI_DRAFTERS,
                   help="override the drafter: " + ", ".join(CLI_DRAFTERS) + " (default: the model's config)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="model precision; auto = the checkpoint's dtype, or for the embedded model bfloat16 where "
                        "the CPU/GPU computes it in hardware, else float32 (default: auto)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's, one per core); see 'threads' below")
    p.add_argument("--compile", action="store_true", help="run the engine's passes through torch.compile (selfspec/compiled.py): minutes of warm-up, then faster steps")
    p.add_argument("--compare", action="store_true",
                   help="after the streamed answer, time plain generate of the same model and dtype against "
                        "selfspec on the same prompt and settings, interleaved (--rounds each), and print both")
    p.add_argument("--rounds", type=_positive_int, default=2, help="timed runs of each with --compare (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: 0)")
    p.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    return p


def generation_kwargs(args) -> dict:
    """generate() keyword arguments from the flags: --temperature / --top-p imply sampling."""
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature} (greedy decoding is the default: leave "
                         "out --sample, --temperature and --top-p).")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}.")
    sample = args.sample or args.temperature is not None or args.top_p is not None
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=sample)
    if sample:
        gen.update(temperature=1.0 if args.temperature is None else args.temperature, top_p=args.top_p)
    return gen


def prompt_ids(tok, text: str, chat: bool | None):
    """(1, T) prompt ids: the chat template when asked, or by default when the tokenizer has one."""
    has_template = bool(getattr(tok, "chat_template", None))
    if chat and not has_template:
        raise ValueError("--chat was given but this model's tokenizer has no chat template (a base model, not an "
                         "instruct one): drop --chat to continue the raw text.")
    if chat is None:
        chat = has_template
    if chat:
        from .prompts import chat_input_ids

        return chat_input_ids(tok, text)
    return tok(text, return_tensors="pt")["input_ids"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    gen = generation_kwargs(args)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import TextStreamer
    from transformers.utils import logging as hf_logging

    from .models import dtype_name
    from .pretrained import load

    hf_logging.disable_progress_bar()  # a weight-loading bar on stderr would split the answer from its stats

    overrides = {k: v for k, v in (("exit_layer", args.exit_layer), ("max_draft_tokens", args.max_draft_tokens),
                                   ("drafter", args.drafter)) if v is not None}
    if args.compile:
        overrides["compile"] = True
    model, tok = load(args.model, heads=args.heads, dtype=args.dtype, **overrides)
    ids = prompt_ids(tok, args.prompt, args.chat).to(model.device)
    mask = torch.ones_like(ids)
    streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, streamer=streamer, **gen)
    seconds = time.perf_counter() - start
    st = model.selfspec.last_stats
    cfg = model.selfspec.config
    new_tokens = out.shape[1] - ids.shape[1]
    # the streamer ended the answer with a newline
    speculative = (f"mean accepted tokens {st.mean_accepted_tokens:.2f} | acceptance rate {st.acceptance_rate:.1%}"
                   if st is not None else "ran the plain generate (see the warning above)")
    print(f"[selfspec] {new_tokens} tokens in {seconds:.2f}s = {new_tokens / seconds:.1f} tok/s | {speculative} | "
          f"drafter {cfg.drafter}, exit layer {cfg.exit_layer}, K={cfg.max_draft_tokens}, {dtype_name(model.dtype)}",
          file=sys.stderr)
    if args.compare:
        print(compare_line(model, ids, mask, gen, args.rounds, args.seed), file=sys.stderr)
    return 0


def time_both(model, ids, mask, gen: dict, rounds: int, seed: int = 0) -> dict:
    """Seconds and new tokens of plain `generate` (the class's own, same model object, weights and dtype) and of
    the wrapped one, `rounds` runs each, interleaved and alternating which goes first; same ids and kwargs."""
    import torch
    from transformers import GenerationMixin

    from .tools.measure import timed

    runs = {
        "plain": lambda: GenerationMixin.generate(model, ids, attention_mask=mask, **gen),
        "selfspec": lambda: model.generate(ids, attention_mask=mask, **gen),
    }
    totals = {name: {"seconds": 0.0, "tokens": 0, "outputs": []} for name in runs}
    for r in range(rounds):
        for name in (("plain", "selfspec") if r % 2 == 0 else ("selfspec", "plain")):
            torch.manual_seed(seed + r)
            out, seconds = timed(runs[name], model.device)
            totals[name]["seconds"] += seconds
            totals[name]["tokens"] += out.shape[1] - ids.shape[1]
            totals[name]["outputs"].append(out)
    return totals


def compare_line(model, ids, mask, gen: dict, rounds: int, seed: int = 0) -> str:
    t = time_both(model, ids, mask, gen, rounds, seed)
    rate = {name: t[name]["tokens"] / t[name]["seconds"] for name in t}
    line = (f"[compare] plain generate {rate['plain']:.1f} tok/s, selfspec {rate['selfspec']:.1f} tok/s "
            f"({rate['selfspec'] / rate['plain']:.2f}x); {rounds} run{'s' if rounds > 1 else ''} each, interleaved, "
            "same prompt and settings")
    if not gen.get("do_sample"):
        line += "; greedy outputs " + greedy_verdict(model, ids, t["plain"]["outputs"], t["selfspec"]["outputs"],
                                                     gen["max_new_tokens"])
    return line


def greedy_verdict(model, ids, plain: list, spec: list, max_new: int) -> str:
    """'identical', or the verdict (selfspec/tools/verdict.py) on the first round whose outputs part: a near-tie
    that half-precision rounding between pass shapes can flip, or a difference no rounding explains (a bug).
    ids (1, T); each output (1, T + new)."""
    from .tools.calibrate.trials import pad_id_of
    from .tools.verdict import DIFFERS, PlainLogits, judge, verify_chunk

    prompt, n = ids[0].tolist(), ids.shape[1]
    logits = PlainLogits(model, {"pad_token_id": pad_id_of(model)})
    chunk = verify_chunk(model.selfspec.config)
    for want, got in zip(plain, spec):
        v = judge(model, logits, prompt, got[0, n:].tolist(), want[0, n:].tolist(), max_new, chunk=chunk)
        if v is None:
            continue
        if v.kind == DIFFERS:
            return f"DIFFER at new token {v.index} ({v.why()}): not a near-tie, a bug; please report it with " \
                   "this command"
        return f"part at new token {v.index}, a near-tie of this dtype ({v.why()}; see README, Precision)"
    return "identical"


if __name__ == "__main__":
    from .cli import main as cli_main

    sys.exit(cli_main(["generate", *sys.argv[1:]]))
