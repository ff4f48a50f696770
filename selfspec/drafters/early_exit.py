"""Draft with the model's own layers [0, E) plus an exit head, writing layers [0, E) of the shared cache."""
from __future__ import annotations

import dataclasses

import torch

from ..cache import SpecCache
from ..draft_length import chain_may_draft
from ..forward import forward_early, run_module
from ..heads import DraftLogits, ExitHead, draft_scores
from .base import ConfidenceRule, Draft, Drafter, choose_draft
from .ngram import _PAD, SuffixIndex
from .tree import grow_tree


class EarlyExitDrafter(Drafter):
    name = "early_exit"
    uses_early_layers = True
    drafts_trees = True

    def __init__(self, head: ExitHead, rule: ConfidenceRule | float = ConfidenceRule()):
        self.head = head
        self.exit_layer = head.exit_layer
        self.rule = rule if isinstance(rule, ConfidenceRule) else ConfidenceRule(float(rule))  # a bare threshold
        self.head_cache: HeadCache | None = None
        # a head with a KV cache of its own takes the prompt in first; a top-reading head its last final state
        self.needs_prompt_hidden = head.stateful or head.reads_top
        self.tops = TopStates() if head.reads_top else None
        self.copies = CopyPaths(head.copy_max) if head.copy_max else None
        self.runs_copies = self.copies is not None  # its chains may run past K while they copy (draft_length)

    def copy_runs_missing(self) -> str | None:
        if self.runs_copies:
            return None
        return (f"the head at layer {self.exit_layer} has no copy lookup: use heads trained with copy_max > 0")

    @property
    def threshold(self) -> float:
        """The rule's threshold, which a tree's nodes' path probabilities must reach (tree.py)."""
        return self.rule.threshold

    def begin(self, state) -> None:
        self.head_cache = HeadCache(self.head, state) if self.head.stateful else None
        if self.tops is not None:
            self.tops.begin(state)
        if self.copies is not None:
            self.copies.begin(state)

    def accepted(self, state, draft: Draft, n: torch.Tensor) -> None:
        if self.head_cache is not None:
            self.head_cache.catch_up(state)
        if self.tops is not None:
            self.tops.accepted(state, n)
        if self.copies is not None:
            self.copies.start()

    def head_logits(self, state, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                    every: bool = False, parents: torch.Tensor | None = None,
                    inputs: torch.Tensor | None = None) -> DraftLogits:
        """(B, T, H) layer-E states of the inputs just run through layers [0, E), at (B, T) positions -> the draft
        logits (heads.DraftLogits) for the token after the last one (with `every`: at (B, T), after each). A
        stateful head takes all T inputs into its cache; a top-reading head reads each input's parent's state
        (`parents`, see TopStates.normed); a copy head the prompt-lookup candidate after each input (the (B, T)
        `inputs` tokens; without them it drafts as if none matched)."""
        if self.head_cache is not None:
            out = self.head_cache.feed(state, hidden, positions)
            sub = self.head.logits(out if every else out[:, -1:], state.adapter).float()
            scores = DraftLogits(sub, self.head.vocab_ids, state.vocab_size)
            return scores if every else scores.last()
        if self.tops is not None:
            normed = self.tops.normed(self.head, state.adapter, hidden, parents)
            normed = normed if every else normed[:, -1:]
        else:
            normed = self.head.normed(hidden if every else hidden[:, -1:], state.adapter)
        token = match = None
        if self.copies is not None and inputs is not None:
            token, match = self.copies.candidates(state, inputs, parents)  # (B, T): every input joins the paths
            token, match = (token, match) if every else (token[:, -1:], match[:, -1:])
        scores = draft_scores(self.head, state.adapter, normed, state.vocab_size, token, match)  # at (B, T')
        return scores if every else scores.last()

    def run(self, state, inputs: torch.Tensor, positions: torch.Tensor, every: bool = False,
            parents: torch.Tensor | None = None) -> tuple[torch.Tensor, DraftLogits]:
        """(B, T) inputs at (B, T) positions through layers [0, E) (into the shared cache), then the head: their
        (B, T, H) layer-E states and the draft logits for the token after the last one (with `every`: after each,
        as a tree level needs). The inputs are the step's next verify inputs; `parents`
        (B, T) are their parents' verify-input indices in a tree (None: each follows the one before). The hybrid
        drafter runs its head drafts through this too."""
        hidden = forward_early(state.ctx, inputs, positions, self.exit_layer).hidden
        return hidden, self.head_logits(state, hidden, positions, every, parents, inputs)

    def run_level(self, state):
        """The tree grower's level runner: inputs, positions, their parents' verify-input indices (None for the
        root) -> states and logits after every input."""
        return lambda inputs, positions, parents=None: self.run(state, inputs, positions, every=True,
                                                                 parents=parents)

    def propose(self, state, k: int) -> Draft:
        if k == 0:
            return Draft.empty(state.batch, state.device)
        if state.settings.tree_top_k > 1:
            draft = grow_tree(state, self.run_level(state), k, state.settings.tree_top_k, state.settings.tree_size,
                              self.threshold)
            return dataclasses.replace(draft, hidden_layer=self.exit_layer)
        x = state.pending
        active = ~state.finished
        draft_len = torch.zeros_like(state.pending)
        hiddens, tokens, qs = [], [], []
        confidence = 1.0
        most = max(k, state.copy_k) if self.runs_copies else k  # past k only while it copies (draft_length)
        for j in range(most):
            h, logits = self.run(state, x[:, None], state.pos[:, None] + j)
            hiddens.append(h)
            token, probs, top = choose_draft(state, logits, j, scored=True)
            confidence = self.rule.confidence(confidence, top)
            confident = self.rule.confident(confidence)
            # past k: does the distribution's top token copy? Not the sample's own value: whether a sampled draft
            # is proposed must not depend on it, or rejection sampling would not be exact
            copying = logits.copying(token if probs is None else probs.argmax(-1)) if j >= k else None
            take = active & chain_may_draft(j, k, confident, copying)
            draft_len += take.long()
            active = take & ~state.is_eos(token)  # nothing is drafted after an EOS
            tokens.append(token)
            if state.do_sample:
                qs.append(probs)
            state.write_drafts(token[:, None], start=j)
            if j + 1 < most and not bool(active.any()):
                break
            x = token
        width = int(draft_len.max())
        return Draft(
            tokens=torch.stack(tokens[:width], dim=1) if width else tokens[0][:, None][:, :0],
            draft_len=draft_len,
            q=torch.stack(qs[:width], dim=1) if (qs and width) else None,
            hidden=torch.cat(hiddens[: width + 1], dim=1),
            hidden_layer=self.exit_layer,
        )


class TopStates:
    """What a top-reading head reads during one generate call: `last` (B, H), the final-normed state of the last
    verified position (the verifier's own: from prefill, then from each verification at the accepted count), and
    `step`, the head's own normed output for each verify input drafted from so far this step, in input order,
    which the inputs after it read in place of the final states they cannot have yet."""

    def __init__(self):
        self.last, self.step = None, []

    def start(self, last: torch.Tensor) -> None:
        """A new step after the verified position whose final-normed state is `last` (B, H)."""
        self.last, self.step = last, []

    def begin(self, state) -> None:
        self.start(state.prompt_hidden[1][:, -1])  # left padding: the last column is real

    def accepted(self, state, n: torch.Tensor) -> None:
        top = state.last_verify.top  # (B, k + 1, H): the step's inputs (after a tree, its path)
        self.start(top.gather(1, n.to(top.device)[:, None, None].expand(-1, 1, top.shape[-1]))[:, 0])

    def normed(self, head, adapter, hidden: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
        """(B, T, H) layer-E states of the step's next T verify inputs -> the head's (B, T, H) normed outputs,
        kept for the inputs after them. Each input reads its parent's output (`parents` (B, T) verify-input
        indices, from a tree's earlier levels), or with parents=None the one of the input before it, in order;
        the step's first input (the pending token) reads the last verified state."""
        if parents is not None:
            done = torch.cat(self.step, dim=1)  # (B, inputs so far, H)
            out = head.normed(hidden, adapter, done.gather(1, parents[..., None].expand(-1, -1, done.shape[-1])))
            self.step.append(out)
            return out
        outs = []
        for t in range(hidden.shape[1]):  # each needs the one before: an MLP call per input
            prev = self.step[-1][:, -1:] if self.step else self.last[:, None]
            self.step.append(head.normed(hidden[:, t : t + 1], adapter, prev))
            outs.append(self.step[-1])
        return torch.cat(outs, dim=1)


class CopyPaths:
    """What a copy head reads during one generate call: for each verify input of the step, the text that ends with
    it (the row's verified text, whose last token is the pending one, then the drafts on the input's path: a
    chain's earlier drafts or a tree node's ancestors) looked up as prompt lookup does, in a host-side SuffixIndex
    of each row's verified text."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.texts: list[SuffixIndex] = []  # [row]: its verified text so far, prompt padding as _PAD
        self.paths: list[list[tuple]] = []  # [row][verify input of this step]: the drafts after the pending token

    def begin(self, state) -> None:
        prompt = state.seq[:, : state.prompt_len]
        if state.mask is not None:
            prompt = prompt.masked_fill(state.mask == 0, _PAD)
        self.texts = [SuffixIndex(self.n_max) for _ in range(state.batch)]
        for index, row in zip(self.texts, prompt.tolist()):
            index.extend(row)
        self.start()

    def start(self) -> None:
        """A new step: its first input is the pending token (index 0), the last token of the verified text."""
        self.paths = [[] for _ in self.texts]

    def candidates(self, state, inputs: torch.Tensor, parents: torch.Tensor | None):
        """(B, T) the step's next verify inputs (parents: their parents' input indices, None: each follows the one
        before) -> (token (B, T), match (B, T)): each input's copy candidate (-1: none) and its match length."""
        self._catch_up(state)
        inputs_at, parents_at = inputs.tolist(), None if parents is None else parents.tolist()
        token, match = [], []
        for b, (index, paths) in enumerate(zip(self.texts, self.paths)):
            for t, tok in enumerate(inputs_at[b]):
                parent = len(paths) - 1 if parents_at is None else parents_at[b][t]
                paths.append(paths[parent] + (tok,) if paths else ())  # the pending token ends the text itself
                tok, n = index.candidate(paths[-1])
                token.append(tok)
                match.append(n)
        shape = inputs.shape
        return (torch.tensor(token, device=inputs.device).view(shape),
                torch.tensor(match, device=inputs.device).view(shape))

    def _catch_up(self, state) -> None:
        """Index what each row verified since the last step (once a step: the step's paths are still empty)."""
        for b, index in enumerate(self.texts):
            if not self.paths[b] and len(index.tokens) < state.lengths[b]:
                index.extend(state.seq[b, len(index.tokens) : state.lengths[b]].tolist())


class HeadCache:
    """The KV cache of a stateful head during one generate call. Its slots mirror the shared cache: the prompt
    goes in after prefill, each drafted input as the drafter runs it, and after verification it is cut back like
    the shared cache and given the verified inputs it has not seen (for context="top": all of this step's
    verified inputs again, as final-layer states in place of the layer-E states it drafted from)."""

    def __init__(self, head: ExitHead, state):
        self.head, self.cache = head, SpecCache(1)
        early, top = state.prompt_hidden  # (B, T0, H) each, from prefill
        if state.prefill_exit_layer != head.exit_layer:
            raise ValueError(f"The prefill ran to layer {state.prefill_exit_layer}, but the head exits at "
                             f"layer {head.exit_layer}; set config.exit_layer to the head's layer.")
        self.feed(state, top if head.context == "top" else early, state.prompt_positions)

    def feed(self, state, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Run the head's layer on (B, T, H) states entering the next T slots; returns its (B, T, H) output."""
        weight = next(self.head.layer.parameters())
        return run_module(state.ctx, self.head.layer, self.head.source_layer, self.cache,
                          hidden.to(weight.device, weight.dtype), positions.to(weight.device))

    def catch_up(self, state) -> None:
        step = state.last_verify
        verified_len = state.ctx.cache.layer_length(state.adapter.num_layers - 1)
        if self.head.context == "top" or step.kept is not None:  # after a tree: its path, fed again in order
            self.cache.rollback(step.base)
            source = step.top if self.head.context == "top" else step.early
        else:
            self.cache.rollback(verified_len)
            source = step.early
        start = self.cache.layer_length(0)
        if start < verified_len:
            cols = slice(start - step.base, verified_len - step.base)
            self.feed(state, source[:, cols], step.positions[:, cols])
