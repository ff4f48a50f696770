"""The drafter interface: `propose(state, k) -> Draft`, then `accepted(state, n)` after verification."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..heads import DraftLogits
from ..sampling import logits_to_probs, sample


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, k) proposed tokens; columns past a row's draft_len are ignored
    draft_len: torch.Tensor  # (B,) tokens each row proposes, <= k
    q: torch.Tensor | None = None  # (B, k, V) processed draft probabilities; None for point-mass drafts
    # (B, m, H) layer-E states of the first m verify inputs (pending token, then drafts), already run through
    # layers [0, E) into the shared cache; verification runs [0, E) only for inputs m..k.
    hidden: torch.Tensor | None = None
    # the layer E whose input `hidden` is; the loop refuses states from any layer but the one it verifies from
    hidden_layer: int | None = None
    # (B, k) for a draft tree (trees.py): the verify-input index of each node's parent (0: the pending token,
    # i + 1: node i), parents before children. None: a chain. A tree's `hidden` covers the pending token and the
    # first m - 1 nodes, which the drafter ran through layers [0, E) in node order under the tree mask.
    parents: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @staticmethod
    def empty(batch: int, device) -> "Draft":
        return Draft(torch.empty(batch, 0, dtype=torch.long, device=device),
                     torch.zeros(batch, dtype=torch.long, device=device))


class Drafter:
    """Proposes tokens for the verifier. Subclasses override `propose`; `begin`/`accepted` are hooks for drafters
    with state of their own (a draft model's cache, a head's attention cache).

    A drafter only proposes: the loop writes the proposed tokens into the sequence, masks rows that have
    finished and checks that hidden states come from the layer it verifies from (decoding.take_draft). A drafter
    may still write its drafts early (state.write_drafts) so that logits processors reading the prefix see them
    while it drafts the next one; nothing else relies on that.

    A drafter with `drafts_trees` proposes a tree (Draft.parents) when state.settings.tree_top_k > 1; the engine
    asks only drafters that say so, and falls back to chains with a warning for the rest."""

    name = "none"
    uses_early_layers = False
    # Whether `begin` reads state.prompt_hidden, the (B, T0, H) layer-E and final states of the prompt; the loop
    # keeps them through prefill only for drafters that say so.
    needs_prompt_hidden = False
    drafts_trees = False
    # Whether its chains may run past K while they copy (draft_length.copy_budget): the loop grants the config's
    # copy_draft_tokens only to drafters that say so.
    runs_copies = False

    def copy_runs_missing(self) -> str | None:
        """Why this drafter cannot run past K while it copies although it drafts with a head that could (a head
        without a copy lookup), or None. Drafters that never copy have nothing missing: they simply do not run."""
        return None

    def begin(self, state) -> None:
        """Called once after prefill."""

    def propose(self, state, k: int) -> Draft:
        return Draft.empty(state.batch, state.device)

    def accepted(self, state, draft: Draft, n: torch.Tensor) -> None:
        """Called after verification and rollback; n (B,) drafts accepted per row."""


@dataclass(frozen=True)
class ConfidenceRule:
    """When a chain stops drafting: once its next draft's confidence falls below `threshold` (0: never). That
    confidence is the head's top probability for the draft, or with `cumulative` the product of the top
    probabilities of the chain's drafts so far (the path probability a tree ranks its nodes by): a run of sure
    drafts (a copy) goes on, and two unsure ones in a row end the chain. Tensors or floats: the drafters and the
    cost model's replay judge drafts by this one rule."""

    threshold: float = 0.0
    cumulative: bool = False

    @staticmethod
    def of(config) -> "ConfidenceRule":
        return ConfidenceRule(config.draft_confidence_threshold, config.draft_confidence_cumulative)

    def confidence(self, before, top):
        """The next draft's confidence, from the chain's draft before it (`before`; 1.0 at the first) and its own
        top probability `top`."""
        return before * top if self.cumulative else top

    def confident(self, confidence):
        return confidence >= self.threshold


def choose_draft(state, logits, column: int, scored: bool = False):
    """The draft step of every drafter that scores the vocabulary: a drafter's raw (B, V) logits (or a head's
    heads.DraftLogits) for draft column `column` go through the loop's logits processors (the prefix they read ends
    with the drafts of the earlier columns), then each row takes a sample of the processed distribution when
    sampling, else its argmax.

    Returns (token (B,), probs, top): probs (B, V) is the processed distribution (the q of rejection sampling),
    computed when sampling (and for plain logits when `scored`), else None; top (B,) is its top probability when
    `scored` (what a ConfidenceRule judges), else None."""
    if isinstance(logits, DraftLogits):
        if not state.do_sample and not state.settings.processors:  # nothing reads the columns a head never scores
            token, top = logits.greedy()
            return token, None, top if scored else None
        logits = logits.full()
    logits = state.process(logits[:, None], offset=column)[:, 0]
    probs = logits_to_probs(logits) if (state.do_sample or scored) else None
    token = sample(probs) if state.do_sample else logits.argmax(dim=-1)
    return token, probs, probs.max(dim=-1).values if scored else None
