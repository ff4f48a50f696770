"""Draft with the model's own layers [0, E) plus an exit head, writing layers [0, E) of the shared cache."""
from __future__ import annotations

import dataclasses

import torch

from ..cache import SpecCache
from ..forward import forward_early, run_module
from ..heads import ExitHead
from .base import Draft, Drafter, choose_draft
from .tree import grow_tree


class EarlyExitDrafter(Drafter):
    name = "early_exit"
    uses_early_layers = True
    drafts_trees = True

    def __init__(self, head: ExitHead, confidence_threshold: float = 0.0):
        self.head = head
        self.exit_layer = head.exit_layer
        self.threshold = confidence_threshold
        self.head_cache: HeadCache | None = None
        self.needs_prompt_hidden = head.stateful  # a head with a KV cache of its own takes the prompt in first

    def begin(self, state) -> None:
        self.head_cache = HeadCache(self.head, state) if self.head.stateful else None

    def accepted(self, state, draft: Draft, n: torch.Tensor) -> None:
        if self.head_cache is not None:
            self.head_cache.catch_up(state)

    def head_logits(self, state, hidden: torch.Tensor, positions: torch.Tensor | None = None,
                    every: bool = False) -> torch.Tensor:
        """(B, T, H) layer-E states of the inputs just run through layers [0, E), at (B, T) positions -> (B, V)
        draft logits for the token after the last one (with `every`: (B, T, V), after each), over the full
        vocabulary (-inf outside the head's). A stateful head takes all T inputs into its cache."""
        if self.head_cache is not None:
            out = self.head_cache.feed(state, hidden, positions)
            sub = self.head.logits(out if every else out[:, -1:], state.adapter)
        else:
            sub = self.head(hidden if every else hidden[:, -1:], state.adapter)
        sub = sub.float() if every else sub[:, -1].float()
        if self.head.vocab_ids is None:
            return sub
        full = sub.new_full((*sub.shape[:-1], state.vocab_size), float("-inf"))
        return full.index_copy_(sub.dim() - 1, self.head.vocab_ids.to(sub.device), sub)

    def run(self, state, inputs: torch.Tensor, positions: torch.Tensor,
            every: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) inputs at (B, T) positions through layers [0, E) (into the shared cache), then the head: their
        (B, T, H) layer-E states and the (B, V) draft logits for the token after the last one (with `every`:
        (B, T, V), after each, as a tree level needs). The hybrid drafter runs its head drafts through this too."""
        hidden = forward_early(state.ctx, inputs, positions, self.exit_layer).hidden
        return hidden, self.head_logits(state, hidden, positions, every)

    def run_level(self, state):
        """The tree grower's level runner: inputs, positions -> states and logits after every input."""
        return lambda inputs, positions: self.run(state, inputs, positions, every=True)

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
        for j in range(k):
            h, logits = self.run(state, x[:, None], state.pos[:, None] + j)
            hiddens.append(h)
            token, probs, confident = choose_draft(state, logits, j, self.threshold)
            take = active & confident
            draft_len += take.long()
            active = take & ~state.is_eos(token)  # nothing is drafted after an EOS
            tokens.append(token)
            if state.do_sample:
                qs.append(probs)
            state.write_drafts(token[:, None], start=j)
            if j + 1 < k and not bool(active.any()):
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
