"""The decode loop: prefill -> (draft -> verify -> accept -> rollback -> emit)* with stats.

Shapes: B rows; S the token buffer `seq` (B, S) holding each row's left-padded prompt and generated tokens,
`seq_len` (B,) its valid length; `pos` (B,) the position of each row's pending token (the last emitted one,
not yet in the cache); drafts of the current step sit in `seq` right after `seq_len` until verified.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from .distributed import agree_across_ranks
from .draft_length import copy_budget, draft_budget
from .drafters.base import Draft, Drafter, PromptStates, VerifyStep
from .runner import Runner
from .processing import PrefixProcessor
from .sampling import logits_to_probs, sample, verify_greedy, verify_sampling, verify_sampling_lazy
from .trees import gather_inputs, input_depths, tree_ancestors, verify_tree_greedy, verify_tree_sampling
from .view import DraftView


@dataclass
class GenerationStats:
    new_tokens: int = 0
    verify_steps: int = 0  # full-model passes per row, prefill included
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens emitted per verify step, the verifier's own token included (vLLM and Spec-Bench count so)."""
        return self.new_tokens / self.verify_steps if self.verify_steps else 0.0

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + self.draft_seconds + self.verify_seconds

    def to_dict(self) -> dict:
        return {**self.__dict__, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_tokens": self.mean_accepted_tokens}

    def __repr__(self) -> str:
        return (f"GenerationStats(new_tokens={self.new_tokens}, verify_steps={self.verify_steps}, "
                f"drafted={self.drafted_tokens}, accepted={self.accepted_tokens}, "
                f"acceptance_rate={self.acceptance_rate:.3f}, mean_accepted_tokens={self.mean_accepted_tokens:.2f},"
                f" draft_s={self.draft_seconds:.3f}, verify_s={self.verify_seconds:.3f})")


@dataclass
class DecodeSettings:
    max_length: int  # total length, prompt included (HF semantics)
    do_sample: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = 0
    max_draft_tokens: int = 6  # the depth of a draft: drafts per step of a chain, levels of a tree
    copy_draft_tokens: int = 0  # most drafts of a chain that copies (draft_length.copy_budget); 0: never past K
    # draft trees (trees.py): children expanded per node (1: a chain) and most drafted tokens per verify pass
    tree_top_k: int = 1
    tree_size: int = 1
    exit_layer: int = 1  # layer the verifier starts from when a draft brings no hidden states
    processors: PrefixProcessor = field(default_factory=lambda: PrefixProcessor(None))
    criteria: list = field(default_factory=list)  # stopping criteria beyond EOS and max length
    streamer: object = None
    output_scores: bool = False
    # Synchronise the device around drafting and verification so that the per-phase seconds in the stats are
    # true on a GPU (the calibrator's cost model reads them). Off by default: each sync stalls the pipeline.
    timed: bool = False


class DecodeState:
    """Per-call mutable state of the loop; the drafter reads it through `view` (a DraftView) only."""

    def __init__(self, runner: Runner, input_ids, attention_mask, settings: DecodeSettings):
        self.runner, self.settings = runner, settings
        self.batch, self.prompt_len = input_ids.shape
        self.device = input_ids.device
        self.vocab_size = runner.adapter.vocab_size
        self.do_sample = settings.do_sample
        capacity = call_capacity(settings, self.prompt_len)
        self.seq = torch.full((self.batch, capacity), settings.pad_token_id, dtype=torch.long, device=self.device)
        self.seq[:, : self.prompt_len] = input_ids
        self.seq_len = torch.full((self.batch,), self.prompt_len, dtype=torch.long, device=self.device)
        self.mask = attention_mask
        self.pending = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        self.pos = torch.zeros_like(self.pending)
        self.finished = torch.zeros(self.batch, dtype=torch.bool, device=self.device)
        self.eos = torch.tensor(settings.eos_token_ids or [-1], device=self.device)
        self.scores: list[list[torch.Tensor]] = [[] for _ in range(self.batch)]
        # host copies of seq_len and finished, refreshed by emit's one transfer per step, so that the loop's
        # decisions (draft budget, rollback length, when to stop) never wait on the device
        self.lengths: list[int] = [self.prompt_len] * self.batch
        self.done: list[bool] = [False] * self.batch
        self.capacity = capacity
        self.step = 0  # decode steps so far (0: the token after prefill)
        self.copy_k = 0  # this step's copy_budget: how far a chain that copies may run (the loop sets it)
        self.view = DraftView(self)  # what the drafter sees

    @property
    def adapter(self):
        return self.runner.adapter

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.eos)

    def process(self, logits: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """(B, T, V) float32 logits -> processed, position j following seq[b, :seq_len[b] + offset + j]."""
        return self.settings.processors(self.seq, self.seq_len + offset, logits)

    def write_drafts(self, tokens: torch.Tensor, start: int = 0) -> None:
        """Put (B, w) drafted tokens at columns [start, start + w) after each row's sequence, so that later
        positions (processors, emit) see them as prefix."""
        cols = self.seq_len[:, None] + torch.arange(start, start + tokens.shape[1], device=self.device)[None, :]
        self.seq.scatter_(1, cols, tokens)

    def generated(self, row: int) -> torch.Tensor:
        return self.seq[row, self.prompt_len : self.lengths[row]]

    def remaining(self) -> int:
        """Most tokens an unfinished row may still emit."""
        return max((self.settings.max_length - n for n, d in zip(self.lengths, self.done) if not d), default=0)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(state: DecodeState, exit_layer: int, keep_states: bool) -> tuple[torch.Tensor, PromptStates | None]:
    """Run the prompt through all layers; return processed logits (B, 1, V) of the last prompt position and, with
    `keep_states` (a drafter's needs_prompt_hidden), the prompt's states for its `begin`."""
    ids, mask = state.seq[:, : state.prompt_len], state.mask
    if mask is None:
        mask = torch.ones_like(ids)
    runner = state.runner
    runner.cache.reserve(state.capacity if runner.compiled is None else runner.compiled.capacity(state.capacity))
    early, positions = runner.prompt(ids, mask, exit_layer)
    out = runner.remainder(early, positions, exit_layer)
    state.pos = mask.long().sum(-1)  # position of the first generated token
    # layer-E and final-normed states of the whole prompt, (B, T0, H) each: only heads with a cache of their own
    # read them (in Drafter.begin, after which the loop drops them), so other drafters never hold them
    prompt = PromptStates(early, out, positions, exit_layer) if keep_states else None
    return state.process(state.adapter.logits(out[:, -1:]).float()), prompt


def take_draft(state: DecodeState, drafter: Drafter, draft: Draft, k: int, exit_layer: int) -> Draft:
    """The loop's side of the drafter contract: check what a drafter proposed, write the tokens into the
    sequence (emit and the processors read them there), and propose nothing for rows that have finished."""
    name = drafter.name
    tokens = draft.tokens
    most = max(k, state.copy_k)  # a chain that copies may run to copy_k (copy_budget)
    chain_too_long = draft.parents is None and tokens.dim() == 2 and tokens.shape[1] > most  # trees: _check_tree
    if tokens.dim() != 2 or tokens.shape[0] != state.batch or chain_too_long:
        raise ValueError(f"Drafter {name!r} proposed tokens of shape {tuple(tokens.shape)}; the loop asked for at "
                         f"most {most} per row of a batch of {state.batch}: return Draft(tokens=(B, <= k) ids, ...).")
    if draft.hidden is not None:
        if draft.hidden_layer != exit_layer:
            raise ValueError(f"Drafter {name!r} handed over hidden states of layer {draft.hidden_layer}, but the "
                             f"verifier continues from layer {exit_layer}: set the config's exit_layer to the "
                             f"drafter's layer (or draft with a head at layer {exit_layer}).")
        if draft.hidden.shape[1] > tokens.shape[1] + 1:
            raise ValueError(f"Drafter {name!r} handed over {draft.hidden.shape[1]} hidden states for "
                             f"{tokens.shape[1] + 1} verify inputs (the pending token and the drafts).")
        cache, top = state.runner.cache, state.adapter.num_layers - 1
        ran = cache.layer_length(0) - cache.layer_length(top)  # host ints: no sync
        if ran != draft.hidden.shape[1]:  # verification writes layers [0, E) of the inputs after them next
            raise ValueError(f"Drafter {name!r} left {ran} inputs of this step in layers [0, {exit_layer}) of the "
                             f"cache but handed over hidden states for {draft.hidden.shape[1]}: a drafter hands "
                             f"over the states of every input it runs through view.run_early, in order.")
    if draft.parents is not None:
        _check_tree(state, name, draft)
    elif tokens.shape[1]:
        state.write_drafts(tokens)  # a tree's nodes are no prefix of anything: its accepted path is written later
    draft_len = draft.draft_len.clamp(0, tokens.shape[1]).masked_fill(state.finished, 0)
    return dataclasses.replace(draft, draft_len=draft_len)


# the loop's tensors a drafter can reach through its view; none of them may change during a drafter call
GUARDED = ("seq", "seq_len", "pending", "pos", "finished")


def guarded(state: DecodeState, drafter: Drafter, hook, *args):
    """Call a drafter hook (begin, propose, accepted) with the state's read-only view, and refuse a drafter that
    wrote one of the loop's tensors in place meanwhile (a version counter per tensor: no device sync)."""
    before = [getattr(state, name)._version for name in GUARDED]
    out = hook(state.view, *args)
    for name, version in zip(GUARDED, before):
        if getattr(state, name)._version != version:
            raise RuntimeError(f"Drafter {drafter.name!r} wrote the loop's `{name}` in place: a drafter returns its "
                               f"tokens in a Draft and keeps its own state on itself; the loop writes the sequence.")
    return out


def _check_tree(state: DecodeState, name: str, draft: Draft) -> None:
    """Shapes only: checking parents[i] <= i would cost a device sync every step."""
    size = state.settings.tree_size
    if draft.parents.shape != draft.tokens.shape or draft.tokens.shape[1] > size:
        raise ValueError(f"Drafter {name!r} proposed a tree of {tuple(draft.tokens.shape)} tokens with parents of "
                         f"{tuple(draft.parents.shape)}; a tree needs parents of the tokens' shape and at most "
                         f"draft_tree_size={size} nodes per row.")


def verify(state: DecodeState, draft: Draft, exit_layer: int) -> VerifyStep:
    """Run the pending token and the drafts through the layers they have not seen: the pass's record, whose
    final-normed states (B, k + 1, H) `choose` takes the logits it needs from."""
    runner = state.runner
    base = runner.verified_len()  # slots of the verified prefix
    inputs = torch.cat([state.pending[:, None], draft.tokens], dim=1)
    tree = None
    if draft.parents is None:
        positions = state.pos[:, None] + torch.arange(inputs.shape[1], device=state.device)
    else:  # the whole tree's mask, for the nodes the drafter did not run through [0, E) and for layers [E, L)
        ancestors = tree_ancestors(draft.parents, state.settings.max_draft_tokens)
        tree = (base, ancestors)
        positions = state.pos[:, None] + input_depths(ancestors)
    m = 0 if draft.hidden is None else draft.hidden.shape[1]
    hidden = draft.hidden
    if m < inputs.shape[1]:
        fresh = runner.early(inputs[:, m:], positions[:, m:], exit_layer, tree=tree)
        hidden = fresh if hidden is None else torch.cat([hidden, fresh], dim=1)
    out = runner.remainder(hidden, positions, exit_layer, tree=tree)
    return VerifyStep(base, hidden, out, positions)


def choose(state: DecodeState, draft: Draft, step: VerifyStep):
    """Verify a draft from the verify pass's final states (B, k + 1, H). Returns (draft, logits, n, token, step): the
    accepted drafts n (B,) and the verifier's token (B,), the same on every rank of a tensor-parallel job, with the
    chain and its processed logits (B, k' + 1, V) that emit goes on with (k' >= n: a lazy verdict processes no
    column past the ones it reads), and the pass's record as the drafter's `accepted` reads it. A tree is reduced to
    the chain of its accepted path (follow_path), and the record to the path's inputs."""
    if draft.parents is not None:
        return _choose_path(state, draft, step)
    raw = state.adapter.logits(step.top).float()
    if not state.do_sample:
        logits = state.process(raw)
        n, token = verify_greedy(draft.tokens, logits, draft.draft_len)
    elif lazy_processing(state):
        processed = []  # the processed columns, in order: the lazy verdict asks for each once, in order

        def column(j: int) -> torch.Tensor:  # (B, V) the target's distribution at verify column j
            processed.append(state.process(raw[:, j : j + 1], offset=j)[:, 0])
            return logits_to_probs(processed[-1])

        n, token = verify_sampling_lazy(draft.tokens, column, draft.q, draft.draft_len)
        logits = torch.stack(processed, dim=1)
    else:
        logits = state.process(raw)
        n, token = verify_sampling(draft.tokens, logits_to_probs(logits), draft.q, draft.draft_len)
    return (draft, logits, *agree_across_ranks(n, token, draft.tokens, step=state.step), step)


def lazy_processing(state: DecodeState) -> bool:
    """Whether verification processes the target's logits only where its verdict reads them (columns up to the
    first rejection, a tree's walked nodes) instead of all at once. On a CPU the processors' per-row cost decides:
    top-p sorts the whole vocabulary, about 4 ms a row on one core, against a
    step of about 70 ms. On a GPU one batched call is cheaper than a host check per column."""
    return bool(state.settings.processors) and state.device.type == "cpu"


def _choose_path(state: DecodeState, draft: Draft, step: VerifyStep):
    # every node's logits in one LM-head pass: for a few rows the pass costs about one read of the head's
    # weight, so scoring only the walked path level by level would cost more, not less
    raw = state.adapter.logits(step.top).float()  # (B, N + 1, V)
    rows = torch.arange(state.batch, device=state.device)
    if lazy_processing(state):  # trees run prefix-free processors only, so any row can be processed alone
        def logits_at(current: torch.Tensor) -> torch.Tensor:  # (B,) input indices -> (B, V)
            return state.process(raw[rows, current][:, None])[:, 0]
    else:
        logits = state.process(raw)

        def logits_at(current: torch.Tensor) -> torch.Tensor:
            return logits[rows, current]

    depth = state.settings.max_draft_tokens
    if not state.do_sample:
        path, n, token, logits = verify_tree_greedy(draft.tokens, draft.parents, logits_at, draft.draft_len, depth)
    else:
        path, n, token, logits = verify_tree_sampling(draft.tokens, draft.parents, logits_at, draft.draft_len,
                                                      depth, draft.q)
    draft, step = follow_path(state, draft, path, step)
    return (draft, logits, *agree_across_ranks(n, token, draft.tokens, step=state.step), step)


def follow_path(state: DecodeState, draft: Draft, path: torch.Tensor, step: VerifyStep) -> tuple[Draft, VerifyStep]:
    """Turn a verified tree into the chain of its accepted path, (B, D + 1) verify inputs, root first: the path's
    KV moves to the front of the tree's slots in every layer, the slot table and the sequence get the path's
    positions and tokens. Entries past a row's accepted count are junk that rollback
    cuts. Returns the chain draft (its draft_len still counts the tree's nodes, for the stats) and the pass's record
    along the path."""
    runner, base = state.runner, step.base
    runner.cache.gather_slots(base, path)
    positions = state.pos[:, None] + torch.arange(path.shape[1], device=state.device)
    runner.slots.write(base, positions)
    tokens = draft.tokens.gather(1, (path[:, 1:] - 1).clamp(min=0))  # (B, D)
    state.write_drafts(tokens)
    along = VerifyStep(base, gather_inputs(step.early, path), gather_inputs(step.top, path), positions, kept=path)
    return Draft(tokens=tokens, draft_len=draft.draft_len), along


def emit(state: DecodeState, draft: Draft, n: torch.Tensor, token: torch.Tensor, logits: torch.Tensor) -> "Emitted":
    """Append accepted drafts + the verifier's token to each unfinished row, stopping at EOS / max length /
    other criteria. Returns what the host needs of this step, fetched in one transfer."""
    k = draft.k
    emitted = torch.cat([draft.tokens, token[:, None]], dim=1).scatter_(1, n[:, None], token[:, None])
    j = torch.arange(k + 1, device=state.device)[None, :]
    valid = j <= n[:, None]
    stops = valid & (state.is_eos(emitted) | (state.seq_len[:, None] + j + 1 >= state.settings.max_length))
    first_stop = torch.where(stops.any(1), stops.float().argmax(1), torch.full_like(n, k + 1))
    count = torch.minimum(n + 1, first_stop + 1).masked_fill(state.finished, 0)
    done = state.finished | stops.any(1)
    state.seq.scatter_(1, (state.seq_len + n)[:, None], token[:, None])  # the verifier's token after the drafts
    counts, accepted, done_list, draft_len = torch.stack(  # the step's one device -> host transfer
        [count, n, done.long(), draft.draft_len]).tolist()
    if state.settings.criteria:
        counts, done_list = _apply_criteria(state, counts, done_list, logits)
        count = torch.tensor(counts, device=state.device)
        done = torch.tensor(done_list, dtype=torch.bool, device=state.device)
    _record(state, counts, logits)
    live = [not d for d in state.done]
    state.seq_len += count
    state.finished = done
    state.lengths = [a + c for a, c in zip(state.lengths, counts)]
    state.done = [bool(d) for d in done_list]
    return Emitted(counts, accepted, draft_len, live)


@dataclass
class Emitted:
    """Host-side lists (one entry per row) of one step's outcome."""

    counts: list[int]  # tokens appended to each row
    accepted: list[int]  # drafts the verifier accepted (before stops cut the row)
    draft_len: list[int]  # drafts proposed
    live: list[bool]  # rows that were unfinished when the step began


def _apply_criteria(state, counts, done, logits):
    """Extra stopping criteria (stop strings, user criteria) need the row's text after every token."""
    counts, done = list(counts), list(done)
    for b, c in enumerate(counts):
        start = state.lengths[b]
        for j in range(c):
            prefix = state.seq[b : b + 1, : start + j + 1]
            if any(bool(crit(prefix, logits[b : b + 1, j]).any()) for crit in state.settings.criteria):
                counts[b] = j + 1
                done[b] = True
                break
    return counts, done


def _record(state, counts, logits):
    streamer, scores = state.settings.streamer, state.settings.output_scores
    if streamer is None and not scores:
        return
    for b, c in enumerate(counts):
        if not c:
            continue
        start = state.lengths[b]
        if streamer is not None:  # batch 1 only, like HF (its streamers raise on the prompt put otherwise)
            streamer.put(state.seq[b, start : start + c].cpu())
        if scores:
            state.scores[b].extend(logits[b, :c].unbind(0))


def rollback(state: DecodeState, draft: Draft, n: torch.Tensor, token: torch.Tensor, base: int,
             accepted: list[int]) -> None:
    """Keep the verified inputs (pending + accepted drafts) of each row in the cache; the rest become holes.
    `accepted` is n on the host (emit fetched it), so the new length costs no device sync."""
    keep = n + 1
    runner = state.runner
    new_len = base + max(accepted) + 1
    runner.slots.keep_prefix(base, keep, base + draft.k + 1)
    runner.cache.rollback(new_len)
    state.pos = state.pos + keep
    state.pending = token.masked_fill(state.finished, state.settings.pad_token_id)


def speculative_decode(runner: Runner, drafter: Drafter, input_ids, attention_mask, settings: DecodeSettings):
    """Generate from (B, T0) left-padded `input_ids`. Returns (sequences (B, T0 + new), state, stats)."""
    stats = GenerationStats()
    state = DecodeState(runner, input_ids, attention_mask, settings)
    if settings.streamer is not None:
        settings.streamer.put(input_ids.cpu())
    try:
        _decode_steps(drafter, state, settings, stats)
    finally:
        if settings.streamer is not None:  # a consumer thread must see the end, even after an error
            settings.streamer.end()
        release_cache(runner)
    return _sequences(state), state, stats


def call_capacity(settings: DecodeSettings, prompt_len: int) -> int:
    """Slots a call's longest row can need: its whole length, plus room for the widest draft in flight."""
    widest = max(settings.max_draft_tokens, settings.copy_draft_tokens, settings.tree_size)
    return max(settings.max_length, prompt_len) + widest + 2


def slot_capacity(settings: DecodeSettings, batch: int, prompt_len: int) -> int:
    """Slots the call's slot table can need. One row never leaves a hole, so it needs call_capacity. In a batch a
    step's slots advance by the most any row kept, so rows that lead in turn use more slots than any row has
    tokens; each step emits a token for every live row, so at most (widest draft + 1) slots a new token. A slot
    costs one integer a row, so the table is made that large at once rather than grown during the call."""
    if batch == 1:
        return call_capacity(settings, prompt_len)
    widest = max(settings.max_draft_tokens, settings.copy_draft_tokens, settings.tree_size)
    return prompt_len + max(settings.max_length - prompt_len, 0) * (widest + 1) + widest + 2


def release_cache(runner: Runner) -> None:
    """Free the call's KV buffers as soon as the last step is done (the state returned to the caller keeps only
    tokens and scores), and on a CPU hand the freed pages back to the system when they were many: glibc keeps
    freed heap pages mapped, which would leave a long prompt's cache counted in the process's memory."""
    freed = sum(layer.allocated_bytes() for layer in runner.cache.layers)
    runner.cache.reset()
    if runner.slots.pos.device.type == "cpu" and freed >= RETURN_TO_OS_BYTES:
        return_free_memory_to_os()


RETURN_TO_OS_BYTES = 32 * 2**20  # below this the trim costs more than it returns


def return_free_memory_to_os() -> None:
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides for itself
        pass


def _decode_steps(drafter, state, settings, stats) -> None:
    """Prefill, then draft -> verify -> emit -> rollback until every row has finished."""
    t0 = time.perf_counter()
    logits, prompt = prefill(state, settings.exit_layer, drafter.needs_prompt_hidden)
    first = sample(logits_to_probs(logits[:, 0])) if state.do_sample else logits[:, 0].argmax(-1)
    first = agree_across_ranks(torch.zeros_like(first), first, step=0)[1]
    step = emit(state, Draft.empty(state.batch, state.device), torch.zeros_like(first), first, logits)
    rollback_noop(state, first)
    guarded(state, drafter, drafter.begin, prompt)
    del prompt  # read by begin only; a long prompt's (B, T0, H) states are not kept
    if settings.timed:
        _sync(state.device)
    stats.prefill_seconds = time.perf_counter() - t0
    stats.new_tokens, stats.verify_steps = sum(step.counts), state.batch
    while not all(state.done):
        _speculative_step(drafter, state, settings, stats)


def _speculative_step(drafter, state, settings, stats) -> None:
    """One draft -> verify -> emit -> rollback round over the whole batch, with its stats."""
    state.step += 1
    k = draft_budget(settings.max_draft_tokens, state.remaining())
    state.copy_k = copy_budget(settings.copy_draft_tokens, k, state.remaining())
    base = state.runner.verified_len()
    t0 = time.perf_counter()
    draft = take_draft(state, drafter, guarded(state, drafter, drafter.propose, k), k, settings.exit_layer)
    if settings.timed:
        _sync(state.device)
    t1 = time.perf_counter()
    draft, logits, n, token, verified = choose(state, draft, verify(state, draft, settings.exit_layer))
    step = emit(state, draft, n, token, logits)
    rollback(state, draft, n, token, base, step.accepted)
    guarded(state, drafter, drafter.accepted, draft, n, verified)
    if settings.timed:
        _sync(state.device)
    stats.draft_seconds += t1 - t0
    stats.verify_seconds += time.perf_counter() - t1
    stats.verify_steps += sum(step.live)
    stats.new_tokens += sum(step.counts)
    stats.drafted_tokens += sum(d for d, live in zip(step.draft_len, step.live) if live)
    stats.accepted_tokens += sum(min(a, c) for a, c in zip(step.accepted, step.counts))


def rollback_noop(state: DecodeState, first: torch.Tensor) -> None:
    """After prefill the cache already holds exactly the prompt; the first token becomes pending."""
    state.pending = first.masked_fill(state.finished, state.settings.pad_token_id)


def _sequences(state: DecodeState) -> torch.Tensor:
    """Rows padded on the right with pad_token_id to the longest row, as HF's generate returns them."""
    length = max(state.lengths)
    out = state.seq[:, :length].clone()
    j = torch.arange(length, device=state.device)[None, :]
    return out.masked_fill(j >= state.seq_len[:, None], state.settings.pad_token_id)
