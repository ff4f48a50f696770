"""Draft with the model's own layers [0, E) plus an exit head, writing layers [0, E) of the shared cache."""
from __future__ import annotations

import dataclasses

import torch

from ..draft_length import chain_may_draft
from ..head_state import CopyPaths, HeadCache, TopStates
from ..draft_logits import DraftLogits, draft_scores
from ..heads import ExitHead
from .base import ConfidenceRule, Draft, Drafter, DraftView, PromptStates, VerifyStep, choose_draft
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
        self.tops = TopStates() if head.reads_top else None
        self.copies = CopyPaths(head.copy_max) if head.copy_max else None

    @classmethod
    def from_engine(cls, engine) -> "EarlyExitDrafter":
        """The config's exit head with its confidence rule: the early_exit drafter, and the hybrid's head."""
        return cls(engine.head_for(engine.config.exit_layer), ConfidenceRule.of(engine.config))

    @property
    def needs_prompt_hidden(self) -> bool:
        """A head with a KV cache of its own takes the prompt in first; a top-reading head its last final state."""
        return self.head.stateful or self.head.reads_top

    @property
    def runs_copies(self) -> bool:
        """A copy head's chains may run past K while they copy (draft_length)."""
        return self.copies is not None

    def copy_runs_missing(self) -> str | None:
        if self.runs_copies:
            return None
        return (f"the head at layer {self.exit_layer} has no copy lookup: use heads trained with copy_max > 0")

    @property
    def threshold(self) -> float:
        """The rule's threshold, which a tree's nodes' path probabilities must reach (tree.py)."""
        return self.rule.threshold

    def begin(self, view: DraftView, prompt: PromptStates | None) -> None:
        self.head_cache = HeadCache.after_prompt(self.head, view, prompt) if self.head.stateful else None
        if self.tops is not None:
            self.tops.begin(prompt)
        if self.copies is not None:
            self.copies.begin(view)

    def accepted(self, view: DraftView, draft: Draft, n: torch.Tensor, verified: VerifyStep) -> None:
        if self.head_cache is not None:  # before the tops move on: a fused head reads the state before the step
            self.head_cache.catch_up(view, verified, None if self.tops is None else self.tops.last)
        if self.tops is not None:
            self.tops.accepted(verified, n)
        if self.copies is not None:
            self.copies.start()

    def head_logits(self, view, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                    every: bool = False, parents: torch.Tensor | None = None,
                    inputs: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> DraftLogits:
        """(B, T, H) layer-E states of the inputs just run through layers [0, E), at (B, T) positions -> the draft
        logits (draft_logits.DraftLogits) for the token after the last one (with `every`: at (B, T), after each). A
        stateful head takes all T inputs into its cache (`tree`: the step's ancestor matrix in a tree); a
        top-reading head reads each input's parent's state (`parents`, see TopStates.normed); a copy head the
        prompt-lookup candidate after each input (the (B, T) `inputs` tokens; without them it drafts as if none
        matched). A fused head does both: its cached layer reads each input fused with its parent's state."""
        if self.head_cache is not None and self.tops is None:
            out = self.head_cache.feed(view, hidden, positions, tree=tree)
            sub = self.head.logits(out if every else out[:, -1:], view.adapter).float()
            scores = DraftLogits(sub, self.head.vocab_ids, view.vocab_size)
            return scores if every else scores.last()
        if self.head_cache is not None:  # fused: TopStates orders the reads, the head's cache runs its layer
            normed = self.tops.normed(self.head, view.adapter, hidden, parents, run=lambda h, prev, cols: (
                self.head_cache.feed(view, h, positions[:, cols], prev, tree)))
            normed = normed if every else normed[:, -1:]
        elif self.tops is not None:
            normed = self.tops.normed(self.head, view.adapter, hidden, parents)
            normed = normed if every else normed[:, -1:]
        else:
            normed = self.head.normed(hidden if every else hidden[:, -1:], view.adapter)
        token = match = None
        if self.copies is not None and inputs is not None:
            token, match = self.copies.candidates(view, inputs, parents)  # (B, T): every input joins the paths
            token, match = (token, match) if every else (token[:, -1:], match[:, -1:])
        scores = draft_scores(self.head, view.adapter, normed, view.vocab_size, token, match)  # at (B, T')
        return scores if every else scores.last()

    def run(self, view: DraftView, inputs: torch.Tensor, positions: torch.Tensor, every: bool = False,
            parents: torch.Tensor | None = None, tree: torch.Tensor | None = None) -> tuple[torch.Tensor, DraftLogits]:
        """(B, T) inputs at (B, T) positions through layers [0, E) (view.run_early: into the shared cache), then the
        head: their (B, T, H) layer-E states and the draft logits for the token after the last one (with `every`:
        after each, as a tree level needs). The inputs are the step's next verify inputs; `parents` (B, T) are
        their parents' verify-input indices in a tree (None: each follows the one before) and `tree` the step's
        ancestor matrix. The hybrid drafter runs its head drafts through this too."""
        hidden = view.run_early(inputs, positions, self.exit_layer, tree)
        return hidden, self.head_logits(view, hidden, positions, every, parents, inputs, tree)

    def run_level(self, view: DraftView):
        """The tree grower's level runner: inputs, positions, their parents' verify-input indices (None for the
        root) and the tree's ancestor matrix -> states and logits after every input."""
        return lambda inputs, positions, parents, tree: self.run(view, inputs, positions, every=True,
                                                                 parents=parents, tree=tree)

    def propose(self, view: DraftView, k: int) -> Draft:
        if k == 0:
            return Draft.empty(view.batch, view.device)
        if view.settings.tree_top_k > 1:
            draft = grow_tree(view, self.run_level(view), k, view.settings.tree_top_k, view.settings.tree_size,
                              self.threshold)
            return dataclasses.replace(draft, hidden_layer=self.exit_layer)
        x = view.pending
        active = ~view.finished
        draft_len = torch.zeros_like(view.pending)
        hiddens, tokens, qs = [], [], []
        confidence = 1.0
        most = max(k, view.copy_k) if self.runs_copies else k  # past k only while it copies (draft_length)
        for j in range(most):
            h, logits = self.run(view, x[:, None], view.pos[:, None] + j)
            hiddens.append(h)
            token, probs, top = choose_draft(view, logits, tokens, scored=True)
            confidence = self.rule.confidence(confidence, top)
            confident = self.rule.confident(confidence)
            # past k: does the distribution's top token copy? Not the sample's own value: whether a sampled draft
            # is proposed must not depend on it, or rejection sampling would not be exact
            copying = logits.copying(token if probs is None else probs.argmax(-1)) if j >= k else None
            take = active & chain_may_draft(j, k, confident, copying)
            draft_len += take.long()
            active = take & ~view.is_eos(token)  # nothing is drafted after an EOS
            tokens.append(token)
            if view.do_sample:
                qs.append(probs)
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
