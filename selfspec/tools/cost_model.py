"""Predict self-speculative tokens/s from two cheap measurements instead of running every setting.

1. Acceptance (`measure_acceptance`): one teacher-forced pass of the plain model over each calibration text
   (prompt + the model's own greedy answer, `output_hidden_states=True`) gives the layer-E residual stream at
   every answer position. The exit head at E turns it into draft tokens; `agree[i]` says whether the draft for
   answer token i equals the token the full model emitted, `conf[i]` is the head's top probability there.
   Because accepted drafts are exactly the full model's tokens, a greedy draft block starting at token c sees the
   very states of this teacher-forced pass, so replaying the decode loop over `agree`/`conf` (`simulate`, with the
   loop's own rules from replay.py) counts steps, drafted and accepted tokens as the engine would.
2. Timings (`measure_timings`): the engine's own split forward, timed on this device: one pass of T tokens
   through all layers (per-layer cost, T = 1..K+1), the exit head on one token, the LM head on T tokens, the
   prefill of each prompt, and the loop's fixed cost per verify step and per drafted token.

`predict` combines both: seconds = prefill + sum over steps of (drafting + verification + loop overhead).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..cache import SlotTable, SpecCache
from ..drafters.base import ConfidenceRule
from ..draft_length import chain_may_draft, copies
from ..drafters.early_exit import EarlyExitDrafter
from ..head_replay import teacher_forced_candidates, teacher_forced_copy_logits, teacher_forced_logits
from ..runner import Runner
from .measure import fastest
from .replay import accepted_drafts, replay_greedy


# --- acceptance -----------------------------------------------------------------------------------------------
TOP_PROBS = 8  # best head probabilities kept per answer token: a tree with a threshold runs the children reaching it


@dataclass
class Sequence:
    """One calibration text: `prompt` (1, P) ids and the plain model's greedy `answer` (N,) ids."""

    prompt: torch.Tensor
    answer: torch.Tensor


@dataclass
class LayerAcceptance:
    """Per answer token i of each sequence: does the head at `exit_layer` draft it, and how sure is it."""

    exit_layer: int
    agree: list[list[bool]]  # [sequence][i]
    conf: list[list[float]]  # [sequence][i], head's top probability
    # [sequence][i]: tokens the head finds likelier than answer token i (0 = its top choice; a token outside a
    # draft vocabulary gets the vocabulary's size): a tree with top_k children holds it when rank < top_k
    rank: list[list[int]] = field(default_factory=list)
    # [sequence][i]: the head's probability of answer token i (0 outside its draft vocabulary): a tree with a
    # threshold keeps a leaf only while the product of these along its path reaches it
    prob: list[list[float]] = field(default_factory=list)
    # [sequence][i]: the head's TOP_PROBS best probabilities there, best first: how many children of a tree node
    # reach a threshold (the grower runs only those), replayed in simulate_tree
    top: list[list[list[float]]] = field(default_factory=list)
    # [sequence][i]: the head's draft for answer token i copies the text (draft_length.copies: its copy candidate,
    # for a long enough match); empty for a head without a copy lookup. A chain runs past K only on these.
    copying: list[list[bool]] = field(default_factory=list)

    @property
    def agreement(self) -> float:
        """Share of answer tokens the head drafts correctly (the first-draft acceptance rate at threshold 0)."""
        flat = [a for seq in self.agree for a in seq[1:]]  # token 0 comes from the prefill, never drafted
        return sum(flat) / len(flat) if flat else 0.0

    def position_profile(self, max_k: int) -> list[float]:
        """P(draft j accepted | drafts 0..j-1 accepted), j = 0..max_k-1, over every block start: the chance that
        a block reaches one token further, given it got this far (blocks cut by the text's end are not misses)."""
        tried, passed = [0] * max_k, [0] * max_k
        for seq in self.agree:
            for start in range(1, len(seq)):
                for j in range(min(max_k, len(seq) - start)):
                    tried[j] += 1
                    if not seq[start + j]:
                        break
                    passed[j] += 1
        return [p / t if t else 0.0 for p, t in zip(passed, tried)]


def _head_drafts(engine, exit_layer: int, states, ids: torch.Tensor, rows: slice, answer: torch.Tensor):
    """Draft token ids (N,), the head's top probability (N,), the rank of each answer token (N,), its
    probability (N,), the head's TOP_PROBS best probabilities (N, TOP_PROBS) and whether each draft copies (N,)
    (None without a copy lookup) at the `rows` of a text `ids` (1, T) whose hidden states (HF's tuple: embeddings,
    each layer's output, the last one final-normed) are given; answer (N,) holds the tokens the full model emitted
    there."""
    head = engine.head_for(exit_layer)
    candidates = teacher_forced_candidates(head, ids, rows) if head.copy_max else None
    if head.copy_max:  # its candidates come from the text; its logits cover the full vocabulary
        logits, vocab_ids = teacher_forced_copy_logits(head, states, engine.adapter, ids, rows, candidates), None
    else:
        logits, vocab_ids = teacher_forced_logits(head, states, engine.adapter, rows).float(), head.vocab_ids
    probs = logits.softmax(-1)  # (N, V_draft), or (N, V)
    best, order = probs.topk(min(TOP_PROBS, probs.shape[-1]), dim=-1)  # (N, TOP_PROBS), best first
    conf, idx = best[:, 0], order[:, 0]
    column = answer.to(probs.device)
    if vocab_ids is not None:  # the answer token's column in the draft vocabulary, -1 outside it
        lookup = torch.full((engine.adapter.vocab_size,), -1, dtype=torch.long, device=probs.device)
        lookup[head.vocab_ids.to(probs.device)] = torch.arange(head.vocab_ids.numel(), device=probs.device)
        column = lookup[column]
    p_answer = probs.gather(1, column.clamp(min=0)[:, None])
    rank = (probs > p_answer).sum(-1).masked_fill(column < 0, probs.shape[-1])
    drafts = idx if vocab_ids is None else head.token_ids(idx)
    copying = None if candidates is None else copies(drafts, *(c.to(drafts.device) for c in candidates))
    return drafts, conf, rank, p_answer[:, 0].masked_fill(column < 0, 0.0), best, copying


@torch.no_grad()
def measure_acceptance(engine, sequences: list[Sequence], exit_layers: list[int]) -> dict[int, LayerAcceptance]:
    """Teacher-forced agreement of each exit layer's head with the full model's greedy answer."""
    model = engine.model
    out = {e: LayerAcceptance(e, [], []) for e in exit_layers}
    for seq in sequences:
        p, n = seq.prompt.shape[1], seq.answer.numel()
        ids = torch.cat([seq.prompt, seq.answer[None, :].to(seq.prompt.device)], dim=1)  # (1, P + N)
        states = model(ids, output_hidden_states=True).hidden_states  # L + 1 of (1, P + N, H)
        for e in exit_layers:
            # position P - 1 + i predicts answer token i; hidden_states[e] is the input of layer e
            tokens, conf, rank, prob, best, copying = _head_drafts(engine, e, states, ids,
                                                                   slice(p - 1, p - 1 + n), seq.answer)
            out[e].agree.append((tokens.cpu() == seq.answer.cpu()).tolist())
            out[e].conf.append(conf.cpu().tolist())
            out[e].rank.append(rank.cpu().tolist())
            out[e].prob.append(prob.cpu().tolist())
            out[e].top.append(best.cpu().tolist())
            if copying is not None:
                out[e].copying.append(copying.cpu().tolist())
    return out


# --- timings --------------------------------------------------------------------------------------------------
@dataclass
class Timings:
    """Seconds on this device, fastest of repeats."""

    num_layers: int
    layer: list[float]  # layer[T]: one decoder layer on T new tokens (index 0 unused)
    embed: float  # embedding + per-call fixed cost of a split forward
    lm_head: list[float]  # lm_head[T]: final norm + LM head on T tokens (verification), index 0 unused
    head: dict[int, float]  # exit head on one token at layer E, with the drafter's softmax/argmax
    prefill: list[float]  # per calibration prompt
    step_overhead: float = 0.0  # the loop's fixed cost per verify step (accept, emit, rollback, processors)
    draft_overhead: float = 0.0  # the loop's fixed cost per drafted token beyond layers and head

    def layers(self, count: int, tokens: int) -> float:
        return count * self.layer[min(tokens, len(self.layer) - 1)]

    def to_dict(self) -> dict:
        return dict(self.__dict__, head={str(k): v for k, v in self.head.items()})


def _prefilled_context(adapter, prompt: torch.Tensor) -> Runner:
    """A fresh shared cache holding `prompt` (1, P) in every layer, as after the engine's prefill."""
    runner = Runner(adapter, SpecCache(adapter.num_layers), SlotTable(1, prompt.device))
    runner.prompt(prompt, None, adapter.num_layers)  # the engine's own prefill of the layers
    return runner


def _time_tokens_through(runner: Runner, prompt: torch.Tensor, tokens: int, layers: int, repeats: int) -> float:
    """Seconds to run `tokens` new tokens through layers [0, layers) on top of the prompt, then roll back."""
    p = prompt.shape[1]
    ids = prompt[:, :tokens] if prompt.shape[1] >= tokens else prompt[:, :1].expand(1, tokens)
    positions = p + torch.arange(tokens, device=prompt.device)[None, :]

    def step():
        runner.early(ids, positions, layers)
        runner.cache.rollback(p)

    return fastest(step, prompt.device, repeats)


@torch.no_grad()
def measure_timings(engine, prompts: list[torch.Tensor], exit_layers: list[int], max_tokens: int,
                    repeats: int = 5) -> Timings:
    """Time the pieces of a decode step with the engine's own forward on the first prompt's cache."""
    adapter, device = engine.adapter, prompts[0].device
    num_layers = adapter.num_layers
    runner = _prefilled_context(adapter, prompts[0])
    all_layers = [0.0] + [_time_tokens_through(runner, prompts[0], t, num_layers, repeats)
                          for t in range(1, max_tokens + 1)]
    embed = max(0.0, 2 * _time_tokens_through(runner, prompts[0], 1, 1, repeats) - _time_tokens_through(
        runner, prompts[0], 1, 2, repeats))  # t(1 layer) = e + l, t(2 layers) = e + 2l  =>  e = 2 t1 - t2
    layer = [0.0] + [max(all_layers[t] - embed, 0.0) / num_layers for t in range(1, max_tokens + 1)]
    hidden = torch.zeros(1, max_tokens, adapter.hidden_size, dtype=_dtype_of(adapter), device=device)
    lm_head = [0.0] + [fastest(lambda t=t: adapter.logits(adapter.final_norm(hidden[:, :t])).float().argmax(-1),
                               device, repeats) for t in range(1, max_tokens + 1)]
    head = {e: _time_exit_head(engine, e, hidden[:, :1], repeats) for e in exit_layers}
    prefill = [_time_prefill(adapter, prompt, repeats=max(1, repeats // 2)) for prompt in prompts]
    return Timings(num_layers, layer, embed, lm_head, head, prefill)


def _dtype_of(adapter) -> torch.dtype:
    return next(adapter.layers[0].parameters()).dtype


def _time_exit_head(engine, exit_layer: int, hidden: torch.Tensor, repeats: int) -> float:
    """One drafted token's head cost: the head and its greedy choice (DraftLogits.greedy), as the drafter drafts."""
    drafter = EarlyExitDrafter(engine.head_for(exit_layer))
    state = SimpleNamespace(adapter=engine.adapter, vocab_size=engine.adapter.vocab_size)

    def run():
        if drafter.tops is not None:  # each call a step's first draft (any final state of this shape costs the same)
            drafter.tops.start(hidden[:, -1])
        return drafter.head_logits(state, hidden).greedy()

    return fastest(run, hidden.device, repeats)


def _time_prefill(adapter, prompt: torch.Tensor, repeats: int) -> float:
    def run():
        _prefilled_context(adapter, prompt)
    return fastest(run, prompt.device, repeats)


def fit_overheads(timings: Timings, none_step_seconds: float, draft_token_seconds: float | None = None,
                  exit_layer: int | None = None) -> Timings:
    """Loop costs the pieces miss, from short engine runs: `none_step_seconds` is the engine's verify time per
    step with no drafts (one token through all layers + LM head + loop), `draft_token_seconds` its draft time
    per drafted token at `exit_layer` (E layers + head + loop)."""
    base_step = timings.embed + timings.layers(timings.num_layers, 1) + timings.lm_head[1]
    timings.step_overhead = max(0.0, none_step_seconds - base_step)
    if draft_token_seconds is not None:
        base_draft = timings.embed + timings.layers(exit_layer, 1) + timings.head[exit_layer]
        timings.draft_overhead = max(0.0, draft_token_seconds - base_draft)
    return timings


# --- the replayed decode loop --------------------------------------------------------------------------------
@dataclass
class Counts:
    """What a replayed greedy decode did, summed over sequences."""

    new_tokens: int = 0
    steps: int = 0  # verify steps after the prefill
    prefills: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_passes: int = 0  # single-token passes through layers [0, E) + head while drafting
    draft_width: dict[int, int] = field(default_factory=dict)  # trees: T -> level passes of T tokens
    fresh_early: int = 0  # verify inputs that had not been through [0, E) yet (1 token each)
    verify_width: dict[int, int] = field(default_factory=dict)  # T -> steps verifying T tokens

    @property
    def mean_accepted_tokens(self) -> float:
        return self.new_tokens / (self.steps + self.prefills) if self.steps + self.prefills else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def _draft_block(agree, conf, start: int, k: int, rule: ConfidenceRule, eos: list[bool], copy_k: int = 0,
                 copying: list[bool] | None = None) -> tuple[int, int, int]:
    """One step of the early-exit chain from answer token `start`, with the loop's draft-length rule
    (draft_length.chain_may_draft; past k up to copy_k while drafts copy, given `copying`): (passes, drafted,
    accepted).

    Up to the first wrong draft the chain's text is the answer's, so the teacher-forced values are the drafter's.
    After it they are estimates, as for the confidences. The text then ends in the wrong draft: after a wrong free
    draft no match of two tokens is left to copy from, and after a wrong copy the chain follows the copy's source,
    taken to go on copying where the answer does (on the eval split, float32, K=4 and runs to 16: 3.27 drafts a
    step replayed, 3.12 measured; taking every run after a wrong copy to the end instead gives 4.40)."""
    passes = drafted = 0
    confidence = 1.0
    wrong_copied = None  # after the first wrong draft: whether it was a copy
    for j in range(max(k, copy_k) if copying else k):
        passes += 1
        i = start + j
        confidence = rule.confidence(confidence, conf[i])
        copies_here = bool(copying) and copying[i] and wrong_copied is not False
        if not chain_may_draft(j, k, rule.confident(confidence), copies_here):
            break
        drafted += 1
        if wrong_copied is None and not agree[i]:
            wrong_copied = copies_here
        if eos[i]:
            break
    return passes, drafted, accepted_drafts(agree[start : start + drafted])


def _max_new(answer_len: int, is_eos: list[bool], max_new_tokens: int | None) -> int:
    """The generation's max_new_tokens; when not given, an answer that ended without EOS is taken as cut by it."""
    if max_new_tokens is not None:
        return max_new_tokens
    return answer_len + (1 if is_eos and is_eos[-1] else 0)


def simulate(acc: LayerAcceptance, eos: list[list[bool]], k_max: int, threshold: float | ConfidenceRule,
             max_new_tokens: int | None = None, copy_draft_tokens: int = 0) -> Counts:
    """Replay the engine's greedy loop (replay.replay_greedy: its draft budgets and acceptance rule) over the
    teacher-forced agreement of one exit layer, for answers generated with `max_new_tokens`. A threshold alone
    judges each draft by its own top probability (ConfidenceRule(threshold)). With copy_draft_tokens, chains of a
    copy head run past K while they copy (acc.copying)."""
    rule = threshold if isinstance(threshold, ConfidenceRule) else ConfidenceRule(threshold)
    c = Counts()
    copy_draft_tokens = copy_draft_tokens if acc.copying else 0  # a head that cannot copy never runs past K
    for s, (agree, conf, is_eos) in enumerate(zip(acc.agree, acc.conf, eos)):
        copying = acc.copying[s] if copy_draft_tokens else None

        def step(done: int, k: int, copy_k: int) -> int:
            passes, drafted, accepted = _draft_block(agree, conf, done, k, rule, is_eos, copy_k, copying)
            hidden_kept = min(passes, drafted + 1)
            c.fresh_early += (drafted + 1) - hidden_kept
            c.verify_width[drafted + 1] = c.verify_width.get(drafted + 1, 0) + 1
            c.drafted += drafted
            c.accepted += accepted
            c.draft_passes += passes
            return accepted

        n = len(agree)
        c.new_tokens += n
        c.prefills += 1
        c.steps += replay_greedy(n, _max_new(n, is_eos, max_new_tokens), k_max, step, copy_draft_tokens) - 1
    return c


# --- draft trees ----------------------------------------------------------------------------------------------
def tree_shape(depth: int, top_k: int, size: int) -> tuple[list[int], int]:
    """(widths, nodes) of a tree grown to `depth` levels without a threshold: widths[d] nodes are run through
    [0, E) at depth d (widths[0] = 1, the root), `nodes` are drafted in all. The replay's tree (_tree_block) on a
    head whose every probability is alike, so that only the shape rules (drafters.tree.frontier_width) decide."""
    alike = [[1.0 / top_k] * top_k] * depth
    widths, nodes, _ = _tree_block(alike, [0] * depth, [1.0] * depth, 0, depth, top_k, size, 0.0, [False] * depth)
    return widths, nodes


def _tree_block(top, rank, prob, start: int, k: int, top_k: int, size: int, threshold: float, eos) -> tuple:
    """One tree step from answer token `start`, replayed on a tree whose nodes at depth d all have the head's
    distribution at answer token start + d - 1 (its best probabilities `top`): the grower's own rules run on it
    (frontier_width within the size, reaching the threshold, the best leaves after the run nodes). The answer's
    node at depth d, the child of rank rank[i] under the answer's node above it, is in the tree when that node
    was run and its cumulative score places it among the run nodes of its level or the leaves kept. Returns
    (level widths run, nodes drafted, accepted)."""
    from ..drafters.tree import earns_slot, frontier_width

    last = len(rank) - 1
    frontier, widths, run, leaves = [0.0], [1], 0, []  # log-scores of the nodes to run next, of the leaves
    answer, walking, accepted, leaf = 0.0, True, 0, None  # leaf: (depth, score) of an answer node not run
    for level in range(1, k + 1):
        i = min(start + level - 1, last)
        child = [_log(p) for p in (list(top[i][:top_k]) + [0.0] * top_k)[:top_k]]
        children = sorted((f + c for f in frontier for c in child), reverse=True)
        width = min(frontier_width(level, k, top_k, size, run), sum(earns_slot(c, threshold) for c in children))
        if walking:
            answer += _log(prob[i])
            if rank[i] < top_k and width > 0 and answer >= children[width - 1]:
                accepted, walking = level, not eos[i]  # nothing is drafted after an EOS
            else:
                leaf, walking = ((level, answer) if rank[i] < top_k else None), False
        leaves += children[width:]
        if width == 0:
            break
        frontier = children[:width]
        widths.append(width)
        run += width
    room = min(size - run, sum(earns_slot(c, threshold) for c in leaves))
    kept = sorted(leaves, reverse=True)[:room]
    if leaf is not None and kept and leaf[1] >= kept[-1]:
        accepted = leaf[0]
    return widths, run + len(kept), accepted


def _log(p: float) -> float:
    # a probability that rounds to 0 still has a finite log-softmax in the grower, so such a child still counts
    # where no threshold is set
    return math.log(p) if p > 0 else -1e30


def _top_of(acc: "LayerAcceptance", s: int) -> list[list[float]]:
    """The head's best probabilities at each answer token of sequence s, or, for a profile measured without them,
    what its top probability, the answer token's rank and probability tell: the rank tokens above it as likely as
    the top one."""
    if acc.top:
        return acc.top[s]
    return [[c] * min(r, TOP_PROBS) + ([p] if 0 < r < TOP_PROBS else []) or [c]
            for c, r, p in zip(acc.conf[s], acc.rank[s], acc.prob[s])]


def simulate_tree(acc: LayerAcceptance, eos: list[list[bool]], k_max: int, top_k: int, size: int,
                  threshold: float, max_new_tokens: int | None = None) -> Counts:
    """Replay the greedy loop (replay.replay_greedy) with draft trees of the given shape: level passes of
    widths[d] tokens through [0, E) and the head, then one verify pass over the root and every node."""
    c = Counts()
    for s, (rank, prob, is_eos) in enumerate(zip(acc.rank, acc.prob, eos)):
        top = _top_of(acc, s)

        def step(done: int, k: int, _copy_k: int) -> int:  # trees: no runs past K
            widths, nodes, accepted = _tree_block(top, rank, prob, done, k, top_k, size, threshold, is_eos)
            for w in widths:
                c.draft_width[w] = c.draft_width.get(w, 0) + 1
            c.fresh_early += nodes + 1 - sum(widths)
            c.verify_width[nodes + 1] = c.verify_width.get(nodes + 1, 0) + 1
            c.drafted += nodes
            c.accepted += accepted
            return min(accepted, k)

        n = len(rank)
        c.new_tokens += n
        c.prefills += 1
        c.steps += replay_greedy(n, _max_new(n, is_eos, max_new_tokens), k_max, step) - 1
    return c


@dataclass
class Prediction:
    tokens_per_s: float
    seconds: float
    mean_accepted_tokens: float
    acceptance_rate: float


def predict_seconds(counts: Counts, timings: Timings, exit_layer: int) -> float:
    """Wall time of the replayed decode on this device."""
    t = timings
    draft = counts.draft_passes * (t.embed + t.layers(exit_layer, 1) + t.head[exit_layer] + t.draft_overhead)
    draft += sum(passes * (t.embed + t.layers(exit_layer, width) + width * t.head[exit_layer] + t.draft_overhead)
                 for width, passes in counts.draft_width.items())
    fresh = counts.fresh_early * (t.embed + t.layers(exit_layer, 1))
    verify = sum(steps * (t.layers(t.num_layers - exit_layer, width) + t.lm_head[min(width, len(t.lm_head) - 1)])
                 for width, steps in counts.verify_width.items())
    return sum(t.prefill) + draft + fresh + verify + counts.steps * t.step_overhead


def predict(acc: LayerAcceptance, eos: list[list[bool]], timings: Timings, k_max: int, rule: ConfidenceRule,
            max_new_tokens: int | None = None, tree: tuple[int, int] | None = None,
            copy_draft_tokens: int = 0) -> Prediction:
    """tree: (top_k, size) of draft trees; None or top_k 1 for chains (a tree's threshold is on path
    probabilities whatever the rule says of chains); copy_draft_tokens: how far chains run while they copy."""
    if tree is not None and tree[0] > 1:
        counts = simulate_tree(acc, eos, k_max, tree[0], tree[1], rule.threshold, max_new_tokens)
    else:
        counts = simulate(acc, eos, k_max, rule, max_new_tokens, copy_draft_tokens)
    seconds = predict_seconds(counts, timings, acc.exit_layer)
    return Prediction(counts.new_tokens / seconds if seconds > 0 else 0.0, seconds,
                      counts.mean_accepted_tokens, counts.acceptance_rate)


def plain_seconds(timings: Timings, new_tokens: int, sequences: int) -> float:
    """Predicted time of the engine without drafts: every token one full pass."""
    per_token = timings.embed + timings.layers(timings.num_layers, 1) + timings.lm_head[1] + timings.step_overhead
    return sum(timings.prefill) + (new_tokens - sequences) * per_token


# --- prompt lookup (ngram drafter) ---------------------------------------------------------------------------
def ngram_proposals(seq: Sequence, k_max: int, n_max: int, n_min: int, eos_ids: list[int]) -> list[torch.Tensor]:
    """The ngram drafter's proposal (up to k_max tokens) at every answer position done = 1..N-1, computed with
    its own lookup functions on prompt + answer[:done], which is exactly its text when all tokens so far are
    the full model's. Shorter k give prefixes of these proposals."""
    from ..lookup import continuation, cut_after_eos, suffix_match

    full = torch.cat([seq.prompt[0].cpu(), seq.answer.cpu()])
    p = seq.prompt.shape[1]
    eos = torch.tensor(eos_ids or [-1])
    out = []
    for done in range(1, seq.answer.numel()):
        text = full[None, : p + done]
        last = torch.tensor([p + done - 1])
        match, end = suffix_match(text, last, n_max, n_min)
        tokens, length = continuation(text, last, match, end, k_max)
        length = cut_after_eos(tokens, length, lambda t: torch.isin(t, eos))
        out.append(tokens[0, : int(length[0])])
    return out


def simulate_ngram(sequences: list[Sequence], proposals: list[list[torch.Tensor]], eos: list[list[bool]],
                   k_max: int, max_new_tokens: int | None = None) -> Counts:
    """Replay the greedy loop with prompt-lookup drafts: no draft passes, every verify input runs all layers."""
    c = Counts()
    for seq, props, is_eos in zip(sequences, proposals, eos):
        answer, n = seq.answer.cpu(), seq.answer.numel()

        def step(done: int, k: int, _copy_k: int) -> int:
            draft = props[done - 1][:k]
            accepted = accepted_drafts((draft == answer[done : done + draft.numel()]).tolist())
            c.verify_width[draft.numel() + 1] = c.verify_width.get(draft.numel() + 1, 0) + 1
            c.fresh_early += draft.numel() + 1
            c.drafted += draft.numel()
            c.accepted += accepted
            return accepted

        c.new_tokens += n
        c.prefills += 1
        c.steps += replay_greedy(n, _max_new(n, is_eos, max_new_tokens), k_max, step) - 1
    return c


def predict_ngram(counts: Counts, timings: Timings, lookup_seconds: float) -> Prediction:
    """Every step: lookup, then all layers over the pending token and the drafts."""
    t = timings
    verify = sum(steps * (t.embed + t.layers(t.num_layers, width) + t.lm_head[min(width, len(t.lm_head) - 1)])
                 for width, steps in counts.verify_width.items())
    seconds = sum(t.prefill) + verify + counts.steps * (t.step_overhead + lookup_seconds)
    return Prediction(counts.new_tokens / seconds if seconds > 0 else 0.0, seconds,
                      counts.mean_accepted_tokens, counts.acceptance_rate)
