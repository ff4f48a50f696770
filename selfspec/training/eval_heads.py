"""Compare exit-head designs on the Spec-Bench eval split. Reads top to bottom.

    python -m train.eval_heads --per-category 8 --measure mlp:15 attn-top:8
    python -m train.eval_heads --design mine=runs/my-heads --exits 8 12 --measure mine:8

For every prompt: the plain model's greedy answer (timed: the 1.00x baseline), then one teacher-forced pass over
prompt + answer whose hidden states feed every head. Per design and exit layer it reports
  agreement     share of answer tokens the head's first draft gets right (the full model's argmax);
  sim_mat       mean accepted tokens per verify step (the verifier's token included, prefill counted as a step)
                that greedy drafting of K tokens reaches on this text. Greedy verification accepts a draft exactly
                when it equals the reference token, and the head's inputs are the model's own states of the
                accepted text, so this replays the decode loop without running it (an attention head with
                context="top" is replayed round by round: final states before each round, layer-E states inside);
and, for the settings named in --measure, a real `generate` with the wrapped model on the same prompt, checked
token-identical to the baseline: measured mean accepted tokens and tokens/s relative to the baseline, the runs
interleaved prompt by prompt so drift hits all alike.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# ----------------------------------------------------------------------------------------------------------------
# config
SHIPPED = str(Path(__file__).resolve().parents[1] / "assets" / "smollm2-135m")  # the heads shipped in the package


@dataclass
class EvalConfig:
    model: str = "smollm2-135m"  # name or path for selfspec.models.resolve_model
    per_category: int = 8  # prompts per eval category (5 categories: 40 prompts at 8)
    max_new_tokens: int = 128  # greedy answer length per prompt
    max_draft_tokens: int = 4  # K of the replay and of the measured runs
    # design name -> directory written by save_pretrained (None: the model's own norm + LM head, no parameters)
    designs: dict = field(default_factory=lambda: {
        "norm": None, "mlp": SHIPPED, "attn": "runs/smollm2-135m-attn-early", "attn-top": "runs/smollm2-135m-attn-top"})
    exits: list = field(default_factory=lambda: [4, 8, 12, 15])  # exit layers to report (where a design has a head)
    measure: list = field(default_factory=list)  # "design:E" settings to run for real and time
    threads: int | None = 1  # torch intra-op threads (1: steady timings on a shared CPU)
    output: str = "bench_results/heads-eval"  # results.md + results.json


def parse_args(argv) -> EvalConfig:
    d = EvalConfig()
    p = argparse.ArgumentParser(prog="python -m train.eval_heads", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--per-category", type=int, default=d.per_category)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--max-draft-tokens", type=int, default=d.max_draft_tokens)
    p.add_argument("--design", action="append", default=[], metavar="NAME=DIR",
                   help="add or replace a design (DIR from save_pretrained; 'none' for the plain exit)")
    p.add_argument("--only", nargs="+", default=None, help="keep only these designs")
    p.add_argument("--exits", type=int, nargs="+", default=d.exits)
    p.add_argument("--measure", nargs="+", default=[], metavar="DESIGN:E")
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--output", default=d.output)
    a = p.parse_args(argv)
    designs = dict(d.designs)
    for item in a.design:
        name, _, path = item.partition("=")
        designs[name] = None if path.lower() in ("", "none") else path
    if a.only:
        designs = {k: v for k, v in designs.items() if k in a.only}
    for item in a.measure:
        name, _, e = item.partition(":")
        if name not in designs or not e.isdigit():
            raise SystemExit(f"--measure {item!r}: expected DESIGN:E with DESIGN one of {sorted(designs)}.")
    return EvalConfig(a.model, a.per_category, a.max_new_tokens, a.max_draft_tokens, designs, a.exits, a.measure,
                      a.threads, a.output)


# ----------------------------------------------------------------------------------------------------------------
# heads: each design's heads, loaded once through the same path users take (wrap with a saved directory)
def load_designs(model, cfg: EvalConfig) -> dict:
    """{(design, E): head} for every design and exit layer that has one (the plain exit exists everywhere)."""
    import selfspec

    heads = {}
    for name, path in cfg.designs.items():
        selfspec.wrap(model, path) if path else selfspec.wrap(model)
        for e in cfg.exits:
            if path is None or e in model.selfspec.heads:
                heads[(name, e)] = model.selfspec.head_for(e)
        selfspec.unwrap(model)
    return heads


# ----------------------------------------------------------------------------------------------------------------
# replay: what the decode loop would accept, from one teacher-forced pass
@torch.no_grad()
def first_drafts(head, adapter, states, p: int, n: int, ranks: int = 1, text=None) -> torch.Tensor:
    """(n, ranks) the head's `ranks` best drafts for answer token i, best first, made from the state of the token
    before it (all rounds' first drafts; for stateless and context="early" heads also every later draft, since
    their inputs are the same). Column 0 is the draft a chain makes; the others are what a tree's root adds.
    A copy head also reads its candidates from `text` (1, p + n), the prompt and answer."""
    from selfspec.head_replay import teacher_forced_copy_logits, teacher_forced_logits

    rows = slice(p - 1, p - 1 + n)
    if head.copy_max:
        return teacher_forced_copy_logits(head, states, adapter, text, rows).topk(ranks, dim=-1).indices
    logits = teacher_forced_logits(head, states, adapter, rows)  # (n, V_draft)
    return head.token_ids(logits.topk(ranks, dim=-1).indices)


@torch.no_grad()
def replay(head, adapter, states, answer: torch.Tensor, p: int, k: int, max_new: int, text=None) -> int:
    """Verify steps of greedy decoding with K = k drafts per step on this answer (generated with max_new new
    tokens), counted by the loop's own rules (selfspec.tools.replay): a step after answer token done - 1 drafts
    the head's tokens for done, done + 1, ... and the verifier accepts them while they equal the answer. A copy
    head looks its candidates up in `text` (1, p + n): while drafts equal the answer, that is the drafter's text."""
    from selfspec.tools.replay import accepted_drafts, replay_greedy

    n = answer.numel()
    rounds = FusedRounds(head, adapter, states, text) if head.stateful and head.reads_top else \
        TopRounds(head, adapter, states) if head.stateful and head.context == "top" else \
        TopChain(head, adapter, states, text) if head.reads_top else None
    hits = None if rounds else (first_drafts(head, adapter, states, p, n, text=text)[:, 0] == answer).tolist()

    def step(done: int, room: int, _copy_room: int) -> int:  # K drafts every step: no copy runs past it
        if rounds is None:
            return accepted_drafts(hits[done : done + room])
        return accepted_drafts((rounds.drafts(p + done - 1, room) == answer[done : done + room]).tolist()
                               if room else [])

    return replay_greedy(n, max_new, k, step)


class TopRounds:
    """Drafts of a context="top" attention head, round by round, as the decode loop feeds it: its cache holds
    final states up to the round's first position r, then the round's layer-E states. Rounds only move forward,
    so each call adds the final states of the positions verified since the last one and cuts the last round's
    layer-E entries: linear in the text, not quadratic."""

    def __init__(self, head, adapter, states):
        from selfspec.cache import SpecCache

        self.head, self.adapter = head, adapter
        self.early, self.top = states[head.exit_layer], states[-1]  # (1, T, H)
        self.cache, self.have_top = SpecCache(1), 0  # slots [0, have_top) hold final states

    def _attend(self, hidden, start: int) -> torch.Tensor:
        from selfspec.masks import build_mask

        t = hidden.shape[1]
        slots = torch.arange(start + t)[None]
        mask = build_mask(slots, slots[:, start:], start, self.adapter.window(self.head.source_layer),
                          hidden.dtype, self.adapter.attn_impl)
        return self.head.attend(hidden, self.adapter, slots[:, start:], mask, self.cache)

    def drafts(self, r: int, room: int) -> torch.Tensor:
        """(room,) draft ids for positions r+1 .. r+room of a round whose pending token sits at position r."""
        self.cache.rollback(self.have_top)
        if self.have_top < r:
            self._attend(self.top[:, self.have_top : r], self.have_top)
            self.have_top = r
        out = self._attend(self.early[:, r : r + room], r)
        return self.head.token_ids(self.head.logits(out, self.adapter)[0].argmax(-1))


class FusedRounds(TopRounds):
    """Drafts of a fused head (heads.FusedHead), round by round: its cache holds the verified positions fused with
    the final states before them up to the round's first position r; the round's drafts enter one at a time, each
    fused with the head's estimate of the state before it (the first with the true one)."""

    def __init__(self, head, adapter, states, text=None):
        super().__init__(head, adapter, states)
        from selfspec.heads import previous_top
        from selfspec.lookup import prefix_copy_candidates

        self.prev = previous_top(self.top)
        self.verified = head.fused(self.early, adapter, self.prev)  # (1, T, H) what verified positions enter as
        if head.copy_max:  # (T,) candidate after each position of the text, and its match length
            self.copy = [torch.tensor(c) for c in prefix_copy_candidates(text[0].tolist(), head.copy_max)]

    def drafts(self, r: int, room: int) -> torch.Tensor:
        from selfspec.draft_logits import draft_logits, lm_logits

        self.cache.rollback(self.have_top)
        if self.have_top < r:
            self._attend(self.verified[:, self.have_top : r], self.have_top)
            self.have_top = r
        prev, ids = self.prev[:, r : r + 1], []
        for i in range(r, r + room):
            prev = self.head.normed_out(self._attend(self.head.fused(self.early[:, i : i + 1], self.adapter, prev),
                                                     i), self.adapter)
            if self.head.copy_max:
                token, match = (c[i : i + 1][None] for c in self.copy)
                ids.append(draft_logits(self.head, self.adapter, prev, self.adapter.vocab_size, token,
                                        match)[0, -1].argmax(-1))
            else:
                ids.append(self.head.token_ids(lm_logits(self.adapter, prev, self.head.vocab_ids)[0, -1].argmax(-1)))
        return torch.stack(ids) if ids else torch.zeros(0, dtype=torch.long)


class TopChain:
    """Drafts of a top-reading MLP head as the decode loop makes them (the drafter's own TopStates): a round whose
    pending token sits at r reads the final state at r - 1, each later draft the head's own estimate before it."""

    def __init__(self, head, adapter, states, text=None):
        from selfspec.head_state import TopStates
        from selfspec.lookup import prefix_copy_candidates

        self.head, self.adapter, self.tops = head, adapter, TopStates()
        self.early, self.top = states[head.exit_layer], states[-1]  # (1, T, H)
        if head.copy_max:  # (T,) candidate after each position of the text, and its match length
            self.copy = [torch.tensor(c) for c in prefix_copy_candidates(text[0].tolist(), head.copy_max)]

    def drafts(self, r: int, room: int) -> torch.Tensor:
        """(room,) draft ids for positions r+1 .. r+room of a round whose pending token sits at position r."""
        from selfspec.draft_logits import draft_logits, lm_logits

        if room == 0:
            return torch.zeros(0, dtype=torch.long)
        self.tops.start(self.top[:, r - 1] if r > 0 else torch.zeros_like(self.top[:, 0]))
        normed = self.tops.normed(self.head, self.adapter, self.early[:, r : r + room], None)  # (1, room, H)
        if not self.head.copy_max:
            return self.head.token_ids(lm_logits(self.adapter, normed, self.head.vocab_ids)[0].argmax(-1))
        token, match = (c[r : r + room][None] for c in self.copy)
        return draft_logits(self.head, self.adapter, normed, self.adapter.vocab_size, token, match)[0].argmax(-1)


# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    """Sums over prompts for one (design, exit) or one measured setting."""

    hits: int = 0
    hits_top4: int = 0  # answer tokens among the head's four best first drafts (what a top-4 tree root offers)
    drafted: int = 0  # answer tokens after the first (each is some step's first draft once)
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    near_ties: int = 0  # outputs that part from plain generate's at a near-tie of half-precision rounding
    differs: int = 0  # outputs that part from it where no rounding explains it: a bug
    by_category: dict = field(default_factory=dict)  # category -> [hits, drafted]

    def add_agreement(self, category: str, hits: int, drafted: int) -> None:
        self.hits, self.drafted = self.hits + hits, self.drafted + drafted
        cat = self.by_category.setdefault(category, [0, 0])
        cat[0], cat[1] = cat[0] + hits, cat[1] + drafted

    @property
    def agreement(self) -> float:
        return self.hits / max(1, self.drafted)

    @property
    def top4(self) -> float:
        return self.hits_top4 / max(1, self.drafted)

    @property
    def mat(self) -> float:
        return self.tokens / max(1, self.steps)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    import selfspec
    from selfspec.tools.measure import eos_ids_of, machine_info, timed, versions
    from selfspec.models import resolve_model
    from selfspec.prompts import chat_input_ids, load_prompts
    from selfspec.tools.calibrate.trials import pad_id_of
    from selfspec.tools.verdict import DIFFERS, NEAR_TIE, PlainLogits, judge, verify_chunk
    from tqdm import tqdm

    model, tok = resolve_model(cfg.model)
    adapter = selfspec.arch.adapter_for(model)
    heads = load_designs(model, cfg)
    measure = [(m.partition(":")[0], int(m.partition(":")[2])) for m in cfg.measure]
    prompts = load_prompts(split="eval", limit_per_category=cfg.per_category)
    gen = dict(max_new_tokens=cfg.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    eos = set(eos_ids_of(model, tok))
    print(f"{len(prompts)} eval prompts; designs x exits: {sorted(heads)}; measured: {measure}")

    model.generate(chat_input_ids(tok, "Warm up."), **{**gen, "max_new_tokens": 8})  # first-call costs
    plain = PlainLogits(model, {"pad_token_id": pad_id_of(model)})  # what a divergence is judged against
    replays = {key: Tally() for key in heads}
    runs = {key: Tally() for key in [("hf-greedy", 0)] + measure}
    for i, prompt in enumerate(tqdm(prompts, desc="eval-heads")):
        ids = chat_input_ids(tok, prompt.text)
        p = ids.shape[1]
        with torch.no_grad():
            out, seconds = timed(lambda: model.generate(ids, **gen), model.device)
        answer = out[0, p:]
        base = runs[("hf-greedy", 0)]
        base.tokens, base.seconds = base.tokens + answer.numel(), base.seconds + seconds
        # every design from one teacher-forced pass over prompt + answer
        with torch.no_grad():
            states = model(out, output_hidden_states=True).hidden_states  # L + 1 of (1, p + n, H)
        for key, head in heads.items():
            ranked = first_drafts(head, adapter, states, p, answer.numel(), ranks=4, text=out)[1:]  # (n - 1, 4)
            hits = (ranked[:, 0] == answer[1:]).sum()
            t = replays[key]
            t.add_agreement(prompt.category, int(hits), answer.numel() - 1)
            t.hits_top4 += int((ranked == answer[1:, None]).any(-1).sum())
            steps = replay(head, adapter, states, answer, p, cfg.max_draft_tokens, cfg.max_new_tokens, text=out)
            t.steps, t.tokens = t.steps + steps, t.tokens + answer.numel()
        # the measured settings, in an order that rotates per prompt
        for j in range(len(measure)):
            name, e = measure[(i + j) % len(measure)]
            path = cfg.designs[name]
            # the design itself: K drafts every step, whatever a calibrated config next to the heads says
            setting = dict(exit_layer=e, max_draft_tokens=cfg.max_draft_tokens, drafter="early_exit",
                           draft_confidence_threshold=0.0)
            selfspec.wrap(model, path, **setting) if path else selfspec.wrap(model, **setting)
            try:
                got, seconds = timed(lambda: model.generate(ids, **gen), model.device)
                stats, chunk = model.selfspec.last_stats, verify_chunk(model.selfspec.config)
            finally:
                selfspec.unwrap(model)
            t = runs[(name, e)]
            t.tokens, t.steps = t.tokens + stats.new_tokens, t.steps + stats.verify_steps
            t.seconds += seconds
            verdict = judge(model, plain, ids[0].tolist(), got[0, p:].tolist(), answer.tolist(), cfg.max_new_tokens,
                            chunk=chunk)
            if verdict is not None:  # half precision: a near-tie, or a bug (tools/verdict.py)
                t.near_ties, t.differs = t.near_ties + (verdict.kind == NEAR_TIE), t.differs + (verdict.kind == DIFFERS)
                tqdm.write(f"{name} E={e} parts from plain generate on question {prompt.question_id}: "
                           f"{verdict.kind} ({verdict.why()})")

    write_report(cfg, prompts, replays, runs, {"machine": machine_info(torch.device("cpu")), "versions": versions(),
                                               "eos_ids": sorted(eos)})
    return 0 if not any(t.differs for t in runs.values()) else 1


# ----------------------------------------------------------------------------------------------------------------
def exactness(run: Tally) -> str:
    """The measured column `exact`: yes, the near-ties of half precision, or the differences that are bugs."""
    if run.differs:
        return f"**{run.differs} differ**"
    return f"{run.near_ties} near-tie{'s' * (run.near_ties != 1)}" if run.near_ties else "yes"


def write_report(cfg, prompts, replays, runs, meta) -> None:
    base = runs[("hf-greedy", 0)]
    base_tps = base.tokens / base.seconds
    lines = [f"# Exit-head designs on the eval split ({len(prompts)} prompts, greedy, {cfg.max_new_tokens} new tokens, "
             f"K = {cfg.max_draft_tokens})", "",
             f"Plain `model.generate`: {base_tps:.2f} tok/s (the 1.00x of the measured rows).", "",
             "| design | exit | agreement | in top 4 | mean accepted (replay) | mean accepted (measured) | tok/s "
             "| vs generate | exact |", "|---|---|---|---|---|---|---|---|---|"]
    for (name, e), t in sorted(replays.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        run = runs.get((name, e))
        measured = ("| {:.2f} | {:.2f} | {:.2f}x | {} |".format(run.mat, run.tokens / run.seconds,
                                                                 run.tokens / run.seconds / base_tps,
                                                                 exactness(run))
                    if run else "| | | | |")
        lines.append(f"| {name} | {e} | {t.agreement:.1%} | {t.top4:.1%} | {t.mat:.2f} {measured}")
    categories = sorted({p.category for p in prompts})
    lines += ["", "Agreement per category:", "", "| design | exit | " + " | ".join(categories) + " |",
              "|---|---|" + "---|" * len(categories)]
    for (name, e), t in sorted(replays.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        cells = [f"{t.by_category[c][0] / max(1, t.by_category[c][1]):.1%}" for c in categories]
        lines.append(f"| {name} | {e} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(cfg.output, exist_ok=True)
    with open(os.path.join(cfg.output, "results.md"), "w") as fh:
        fh.write(text)
    record = {"config": asdict(cfg), "meta": meta, "baseline_tok_s": base_tps,
              "replay": [{"design": n, "exit": e, "agreement": t.agreement, "in_top4": t.top4,
                          "mean_accepted_replay": t.mat,
                          "by_category": t.by_category} for (n, e), t in replays.items()],
              "measured": [{"design": n, "exit": e, "mean_accepted": t.mat, "tok_s": t.tokens / max(t.seconds, 1e-9),
                            "near_ties": t.near_ties, "differs": t.differs} for (n, e), t in runs.items()]}
    with open(os.path.join(cfg.output, "results.json"), "w") as fh:
        json.dump(record, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
