"""The drafter contract: a drafter sees a read-only `DraftView` of the decode call and returns a `Draft`.

`propose(view, k) -> Draft` proposes; `begin(view, prompt)` and `accepted(view, draft, n, verified)` let a drafter
keep state of its own (a draft model's cache, a head's attention cache) in step with what the verifier accepted,
from the records the loop hands them (PromptStates, VerifyStep). The loop alone writes the sequence, the positions
and the verified cache (decoding.take_draft, emit, rollback); docs/design.md shows a drafter written against this
contract.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..draft_logits import DraftLogits
from ..sampling import logits_to_probs, sample
from ..view import DraftView


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


@dataclass(frozen=True)
class PromptStates:
    """What the prefill saw of the prompt, handed to `begin` of drafters with `needs_prompt_hidden`."""

    early: torch.Tensor  # (B, T0, H) the prompt's layer-E states (the input of layer `exit_layer`)
    top: torch.Tensor  # (B, T0, H) its final-normed states
    positions: torch.Tensor  # (B, T0) their positions (left padding sits at 0)
    exit_layer: int  # the layer whose input `early` is


@dataclass(frozen=True)
class VerifyStep:
    """What one verification pass saw, handed to `accepted`: for drafters that keep state of their own (a head's KV
    cache, the final states a top-reading head reads)."""

    base: int  # first slot of this step's inputs in the shared cache
    early: torch.Tensor  # (B, k + 1, H) layer-E states of the inputs (pending token, then drafts)
    top: torch.Tensor  # (B, k + 1, H) final-normed last-layer states of the same inputs
    positions: torch.Tensor  # (B, k + 1)
    # after a tree: (B, D + 1) verify inputs of the accepted path, whose states the fields above hold in path order;
    # None after a chain
    kept: torch.Tensor | None = None


class Drafter:
    """Proposes tokens for the verifier. Subclasses override `propose`; `begin`/`accepted` are hooks for drafters
    with state of their own (a draft model's cache, a head's attention cache). Each receives a DraftView.

    A drafter only proposes: the loop writes the proposed tokens into the sequence, masks rows that have
    finished and checks that hidden states come from the layer it verifies from (decoding.take_draft). Logits
    processors see a drafter's earlier drafts through `view.process(logits, drafts)`.

    What a drafter needs is declared on its class (the attributes below) and read by the engine in one place
    (wrap.SelfSpecEngine.call_settings). A drafter with `drafts_trees` proposes a tree (Draft.parents) when
    view.settings.tree_top_k > 1; the engine asks only drafters that say so, and falls back to chains with a
    warning for the rest."""

    name = "none"
    # Whether it runs layers [0, exit_layer) itself (view.run_early) and hands their states over: the verifier
    # then starts from its `exit_layer`, which must be a layer of the model.
    uses_early_layers = False
    exit_layer: int | None = None
    # Whether `begin` reads its `prompt` record (PromptStates, the prompt's layer-E and final states); the loop keeps
    # them through prefill only for drafters that say so, and hands the others None.
    needs_prompt_hidden = False
    drafts_trees = False
    # Whether its chains may run past K while they copy (draft_length.copy_budget): the loop grants the config's
    # copy_draft_tokens only to drafters that say so.
    runs_copies = False

    def copy_runs_missing(self) -> str | None:
        """Why this drafter cannot run past K while it copies although it drafts with a head that could (a head
        without a copy lookup), or None. Drafters that never copy have nothing missing: they simply do not run."""
        return None

    def begin(self, view: DraftView, prompt: PromptStates | None) -> None:
        """Called once after prefill; `prompt` is None unless the drafter has needs_prompt_hidden."""

    def propose(self, view: DraftView, k: int) -> Draft:
        """Up to k tokens per row (a chain), or a tree of at most view.settings.tree_size nodes and k levels."""
        return Draft.empty(view.batch, view.device)

    def accepted(self, view: DraftView, draft: Draft, n: torch.Tensor, verified: VerifyStep) -> None:
        """Called after verification and rollback; n (B,) drafts accepted per row, `verified` what the pass saw."""


@dataclass(frozen=True)
class ConfidenceRule:
    """When a chain stops drafting: once its next draft's confidence falls below `threshold` (0: never). That
    confidence is the head's top probability for the draft, or with `cumulative` the product of the top
    probabilities of the chain's drafts so far (the path probability a tree ranks its nodes by): a run of sure
    drafts (a copy) goes on, and two unsure ones in a row end the chain. Tensors or floats: the drafters and the
    cost model's replay judge drafts by this one rule."""

    threshold: float = 0.0
    cumulative: bool = False
    # the SelfSpecConfig fields this record is read from (registry.DrafterEntry.settings)
    FIELDS: ClassVar[tuple] = ("draft_confidence_threshold", "draft_confidence_cumulative")

    def __post_init__(self):
        if isinstance(self.threshold, bool) or not 0.0 <= float(self.threshold) < 1.0:
            raise ValueError(f"draft_confidence_threshold must be in [0, 1), got {self.threshold!r}.")
        if not isinstance(self.cumulative, bool):
            raise ValueError(f"draft_confidence_cumulative must be true or false, got {self.cumulative!r}.")

    @staticmethod
    def of(config) -> "ConfidenceRule":
        return ConfidenceRule(config.draft_confidence_threshold, config.draft_confidence_cumulative)

    def confidence(self, before, top):
        """The next draft's confidence, from the chain's draft before it (`before`; 1.0 at the first) and its own
        top probability `top`."""
        return before * top if self.cumulative else top

    def confident(self, confidence):
        return confidence >= self.threshold


def choose_draft(view, logits, drafts, scored: bool = False):
    """The draft step of every drafter that scores the vocabulary: a drafter's raw (B, V) logits (or a head's
    draft_logits.DraftLogits) for the draft after `drafts` (the row's drafts before it: (B, w), or a list of w (B,)
    tensors) go through the loop's logits processors (view.process), then each row takes a sample of the processed
    distribution when sampling, else its argmax.

    Returns (token (B,), probs, top): probs (B, V) is the processed distribution (the q of rejection sampling),
    computed when sampling (and for plain logits when `scored`), else None; top (B,) is its top probability when
    `scored` (what a ConfidenceRule judges), else None."""
    if isinstance(logits, DraftLogits):
        if not view.do_sample and not view.settings.processors:  # nothing reads the columns a head never scores
            token, top = logits.greedy()
            return token, None, top if scored else None
        logits = logits.full()
    logits = view.process(logits[:, None], drafts)[:, 0]
    probs = logits_to_probs(logits) if (view.do_sample or scored) else None
    token = sample(probs) if view.do_sample else logits.argmax(dim=-1)
    return token, probs, probs.max(dim=-1).values if scored else None
