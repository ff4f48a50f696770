"""Hybrid drafting: prompt lookup where the context has a good match, the early-exit head elsewhere.

A HybridPolicy decides, per step and row, who drafts. Its `min_match` makes a match strong: a row whose last
`min_match` or more tokens recur earlier in its text. The policies, each adding one rule to the one before:

* `lookup-first`: a row with a strong match drafts that match's continuation (a point-mass draft); every other
  row drafts with the early-exit head.
* `lookup-then-head`: and a row whose continuation is shorter than k keeps drafting with the head after it.
* `lookup-when-unsure`: and a row whose match is too short to be trusted first asks the head and, when the head is
  not confident at its first draft, drafts that shorter match's continuation instead of nothing (prompts that
  quote their context match often but briefly, and there a short match is right more often than an unsure head).
* `lookup-when-copying` (chains; trees draft as `lookup-when-unsure`): and a row whose text with the head's drafts
  so far comes to end in a strong match (the head drafted the first tokens of a copy) takes the rest of that
  match's continuation by lookup, as a point-mass draft, and stops asking the head.

HybridChainDrafter drafts chains; HybridTreeDrafter drafts trees (and chains where the engine asks for them).

Runs past K (config.copy_draft_tokens, chains): a lookup continuation of a match of 2+ tokens is a copy
(draft_length.lookup_budget), so it may run to the step's copy budget, at the step's start and after a rematch; the
head drafts at most K, and a shorter match's continuation too. Whether a row runs depends on its text alone, never on
a sampled token, so rejection sampling stays exact.

Why the early-exit pass runs over the n-gram tokens too
-------------------------------------------------------
`Draft.hidden` holds the layer-E states of the first m verify inputs for *every* row, and the early-exit pass
writes layers [0, E) of the shared cache for those inputs. A batch that mixes n-gram rows and head rows therefore
cannot give some rows hidden states and others none. The choice made here: whenever any row needs the head (a row
without a strong match, or a row to extend), the early-exit pass runs for all rows, and every row is fed the
tokens of its *own* draft: n-gram rows their n-gram tokens (teacher forcing), head rows the head's choices. The
states and cache entries are then exactly those the verifier would compute for the tokens it verifies, so nothing
is stale, and the work is not wasted: the verifier skips layers [0, E) for those inputs. The head's proposal is
used only at a row's first free column. Columns that every extending row already knows (the pending token, then a
common n-gram prefix) are fed as one block rather than one token at a time, so a lone n-gram row that is extended
costs one early-exit pass over its n-gram tokens plus one per head token.

When no row needs the head (every live row has a strong match and nothing to extend), the step is a plain n-gram
draft: no early-exit pass, Draft.hidden = None, and the verifier runs all layers over the drafts in one pass.

With draft trees (draft_tree_top_k > 1) each row's tree is the head's, grown in the nodes that the n-gram branches
(several earlier occurrences, when its match is strong) leave, with the branches grafted onto it (and from
`lookup-when-unsure` on, a shorter match's in the nodes left); a step in which no row needs the head by the
chain's rule (`rows_needing_head`) is a plain n-gram tree, with no early-exit pass.

In sampling mode q is one-hot on n-gram tokens (point mass: accepted with probability p(x), resampled from p with x
removed) and the head's processed distribution on head tokens; both keep rejection sampling exact.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..draft_length import lookup_budget
from ..trees import merge_branches, pack_trees
from .base import Draft, Drafter, DraftView, PromptStates, VerifyStep, choose_draft
from .early_exit import EarlyExitDrafter
from .ngram import NgramDrafter, branch_draft, strong_only
from .tree import grow_tree


@dataclass(frozen=True)
class HybridPolicy:
    """Who drafts a row's step: the lookup, the head, or both in turn (the module's docstring names each policy).
    The rules are read off the name; `min_match` is the match length that makes a lookup strong."""

    name: str = "lookup-then-head"
    min_match: int = 2
    FIELDS: ClassVar[tuple] = ("hybrid_policy", "hybrid_min_match")  # the config fields it is read from

    @staticmethod
    def of(config) -> "HybridPolicy":
        return HybridPolicy(config.hybrid_policy, config.hybrid_min_match)

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"hybrid_policy must be one of {list(POLICIES)}, got {self.name!r}.")
        if not isinstance(self.min_match, int) or self.min_match < 1:
            raise ValueError(f"hybrid_min_match must be an integer >= 1, got {self.min_match!r}.")

    @property
    def extend(self) -> bool:
        """The head continues a lookup draft shorter than k."""
        return POLICIES.index(self.name) >= 1

    @property
    def fallback(self) -> bool:
        """A row whose head is unsure at its first draft takes a short match's continuation."""
        return POLICIES.index(self.name) >= 2

    @property
    def rematch(self) -> bool:
        """A chain whose head drafts come to end in a strong match takes the rest of it by lookup."""
        return POLICIES.index(self.name) >= 3


# each policy adds one rule to the one before it (the module's docstring)
POLICIES = ("lookup-first", "lookup-then-head", "lookup-when-unsure", "lookup-when-copying")


class _Hybrid(Drafter):
    """What the chain and tree hybrids share: the two drafters, the policy and the per-step path counts."""

    name = "hybrid"
    uses_early_layers = True
    runs_copies = True  # its chains' lookup continuations of 2+ token matches run past K (draft_length)

    def __init__(self, early: EarlyExitDrafter, ngram: NgramDrafter, policy: HybridPolicy = HybridPolicy()):
        self.early, self.ngram, self.policy = early, ngram, policy
        self.steps: Counter = Counter()  # steps per path: "ngram", "early_exit", "mixed" (some rows of each)

    @property
    def exit_layer(self) -> int:
        return self.early.exit_layer

    @property
    def needs_prompt_hidden(self) -> bool:
        return self.early.needs_prompt_hidden

    def begin(self, view: DraftView, prompt: PromptStates | None) -> None:
        self.ngram.begin(view, prompt)
        self.early.begin(view, prompt)

    def accepted(self, view: DraftView, draft: Draft, n: torch.Tensor, verified: VerifyStep) -> None:
        self.ngram.accepted(view, draft, n, verified)
        self.early.accepted(view, draft, n, verified)

    def _strong(self, found) -> torch.Tensor:
        """(B,) rows whose lookup found a match of min_match or more tokens with a continuation to draft: the one
        rule by which a chain row takes the lookup's tokens, at the step's start and (rematch) after a head draft."""
        return (found.match >= self.policy.min_match) & (found.length > 0)


class HybridChainDrafter(_Hybrid):
    """The hybrid drafting chains: the lookup's continuation where a row's match is strong, the head's drafts
    elsewhere and after it, as the policy says."""

    def propose(self, view: DraftView, k: int) -> Draft:
        if k == 0:
            return Draft.empty(view.batch, view.device)
        most = max(k, view.copy_k)  # a copy may run to copy_k (copy_budget)
        found = self.ngram.lookup(view, most)
        strong = self._strong(found)
        length = torch.minimum(found.length, lookup_budget(k, most, found.match))  # (B,) what a row may take
        forced_len = length.masked_fill(~strong, 0)  # (B,) n-gram tokens each row takes
        last = found.tokens.gather(1, (forced_len - 1).clamp(min=0)[:, None])[:, 0]
        ends_in_eos = (forced_len > 0) & view.is_eos(last)
        extending = rows_needing_head(~view.finished, strong, forced_len, ends_in_eos, k, self.policy.extend)
        if not bool(extending.any()):
            self.steps["ngram"] += 1
            return _ngram_draft(view, found.tokens, forced_len)
        self.steps["mixed" if bool(strong.any()) else "early_exit"] += 1
        weak_len = length.masked_fill(strong, 0) if self.policy.fallback else torch.zeros_like(forced_len)
        return self._forced_early_exit(view, found.tokens.clone(), forced_len, extending, weak_len, k)

    def _forced_early_exit(self, view: DraftView, tokens, forced_len, extending, weak_len, k: int) -> Draft:
        """Early-exit drafting in which each row's first forced_len tokens are given (tokens (B, most), most >= k:
        a copy runs to most, the head drafts within the first k).

        Input column c of the verify step is the pending token (c = 0) or draft token c - 1. Each round feeds the
        columns every extending row already knows, [fed, end), through layers [0, E); the rows whose first free
        draft column is end - 1 then take the head's proposal there if it is confident enough. A row whose head
        declines its first draft takes its weak_len (B,) n-gram tokens instead (0: none); `tokens` already holds
        them, and no round has fed those columns yet, so whatever is fed later is the draft verified."""
        draft_len = forced_len.clone()
        hiddens, head_q = [], []  # head_q: (column, rows that took the head's token, (B, V) probs)
        confidence = torch.ones(tokens.shape[0], device=tokens.device)  # over each row's head drafts (rule.cumulative)
        rule = self.early.rule
        fed = 0
        while bool(extending.any()):
            end = int(draft_len.masked_fill(~extending, k).min()) + 1
            inputs = torch.cat([view.pending[:, None], tokens], dim=1)[:, fed:end]
            positions = view.pos[:, None] + torch.arange(fed, end, device=view.device)[None, :]
            h, logits = self.early.run(view, inputs, positions)  # (B, end - fed, H), DraftLogits at (B,)
            hiddens.append(h)
            fed, col = end, end - 1
            proposing = extending & (draft_len == col)
            token, probs, top = choose_draft(view, logits, tokens[:, :col], scored=True)
            judged = rule.confidence(confidence, top)
            take = proposing & rule.confident(judged)
            confidence = torch.where(take, judged, confidence)  # forced n-gram tokens do not count
            tokens[:, col] = torch.where(take, token, tokens[:, col])
            if view.do_sample:
                head_q.append((col, take, probs))
            draft_len += take.long()
            if col == 0:  # rows without a forced prefix: an unsure head hands the row to its weak match
                draft_len = torch.where(proposing & ~take, weak_len, draft_len)
            ends = take & view.is_eos(token)  # nothing is drafted after an EOS
            ran = self._rematched(view, tokens, draft_len, take & ~ends, col, k)
            extending = extending & ~(proposing & ~take) & ~ends & ~ran & (draft_len < k)
        width = int(draft_len.max())
        q = _mixed_q(tokens[:, :width], head_q, view.vocab_size) if view.do_sample else None
        return Draft(tokens=tokens[:, :width], draft_len=draft_len, q=q, hidden=torch.cat(hiddens, dim=1),
                     hidden_layer=self.early.exit_layer)

    def _rematched(self, view: DraftView, tokens, draft_len, took, col: int, k: int) -> torch.Tensor:
        """With `rematch`: the rows among `took` (B,) (they just drafted the head's token at column `col`) whose text
        with their drafts through `col` now ends in a strong match take its continuation in the columns after, in
        place in `tokens` (B, most) and `draft_len` (B,), as the lookup's point-mass drafts: to column k, or to
        column most where the match is a copy (lookup_budget). Returns those rows (B,)."""
        most = tokens.shape[1]
        if not self.policy.rematch or col + 1 >= most or not bool(took.any()):
            return torch.zeros_like(took)
        found = self.ngram.lookup(view, most - col - 1, drafts=tokens[:, : col + 1])
        ran = took & self._strong(found)
        length = torch.minimum(found.length, lookup_budget(k, most, found.match) - col - 1).clamp(min=0)
        ran = ran & (length > 0)
        if bool(ran.any()):
            tokens[:, col + 1:] = torch.where(ran[:, None], found.tokens, tokens[:, col + 1:])
            draft_len += torch.where(ran, length, 0)
            self.steps["rematched"] += 1
        return ran


class HybridTreeDrafter(HybridChainDrafter):
    """The hybrid drafting trees: one tree per row, the head's, grown in the nodes that the n-gram branches of rows
    with a strong match leave of draft_tree_size, with those branches grafted onto it (a branch follows the head's
    nodes while they hold its tokens, then hangs below), and from `lookup-when-unsure` on a shorter match's
    branches in the nodes left. Where the engine asks for chains (processors that read the prefix) it drafts them
    as HybridChainDrafter does."""

    drafts_trees = True

    def propose(self, view: DraftView, k: int) -> Draft:
        if k == 0 or view.settings.tree_top_k == 1:
            return super().propose(view, k)
        size, top_k = view.settings.tree_size, view.settings.tree_top_k
        every, match = self.ngram.matched_branches(view, k, top_k)
        strong = strong_only(every, match, self.policy.min_match)
        tries = [merge_branches(b, size) for b in strong]
        if not bool(self._rows_needing_head(view, strong, k).any()):
            # the chain's rule says no row needs the head, so its level passes would only cost (the verifier
            # runs [0, E) over the n-gram nodes itself)
            self.steps["ngram"] += 1
            return branch_draft(view, *pack_trees(tries, view.device))
        taken = max((len(tokens) for tokens, _ in tries), default=0)  # the widest row's trie
        head = grow_tree(view, self.early.run_level(view), k, top_k, size - taken, self.early.threshold)
        # with fallback, a short match's branches fill the nodes the head's tree leaves: many where the head is
        # unsure (its tree stops at the threshold), as the chain drafts them where the head declines
        branches = every if self.policy.fallback else strong
        self.steps["tree" if any(branches) else "early_exit"] += 1
        if not any(branches):  # the head's tree alone (or none: the root's states still spare the verifier [0, E))
            return dataclasses.replace(head, hidden_layer=self.early.exit_layer)
        return _grafted(head, branches, size, self.early.exit_layer)

    def _rows_needing_head(self, view: DraftView, branches, k: int) -> torch.Tensor:
        """rows_needing_head for a tree step, from host lists (no device sync): a row's forced continuation is its
        first branch, the most recent occurrence's, which is the one the chain's lookup takes."""
        first = [b[0] if b else [] for b in branches]
        eos = set(view.settings.eos_token_ids or [])
        facts = ([not d for d in view.done], [bool(b) for b in branches], [len(f) for f in first],
                 [bool(f) and f[-1] in eos for f in first])
        live, strong, forced_len, ends_in_eos = (torch.tensor(f) for f in facts)
        return rows_needing_head(live, strong, forced_len, ends_in_eos, k, self.policy.extend)


def rows_needing_head(live, strong, forced_len, ends_in_eos, k: int, extend: bool) -> torch.Tensor:
    """(B,) rows that need the head this step, from (B,) facts about each row's n-gram continuation (whether it is
    live, its match strong, how many tokens it forces and whether the last is an EOS): the one rule of chains and
    trees. Without `extend` a row with a strong match needs no head; with it, every live row does except one whose
    forced draft fills all k tokens or ends in an EOS. (A chain extends a short match with head tokens after it; a
    tree grows the head's tree from the root and grafts the n-gram branches onto it.)"""
    if not extend:
        return live & ~strong
    return live & (forced_len < k) & ~ends_in_eos


def _grafted(head: Draft, branches, size: int, exit_layer: int) -> Draft:
    """The head's tree (B, W) with each row's n-gram branches grafted onto it by merge_branches. Grafting, not
    hanging the branches under the root beside it: where the head's node holds a branch's first token, a second
    child of that token would be verified for nothing (greedy takes the first of equal siblings, the head's, and
    with it loses the branch below the other; sampling has taken the token out of the residual)."""
    width = head.tokens.shape[1]
    bases = zip(head.tokens.tolist(), head.parents.tolist()) if width else [((), ())] * len(branches)  # one sync
    grafts = [merge_branches(b, size, base) for b, base in zip(branches, bases)]
    tokens, parents, lengths = pack_trees([(t[width:], p[width:]) for t, p in grafts], head.tokens.device)
    head_parents = head.parents if width else head.tokens  # (B, 0): the head drafted none
    return Draft(tokens=torch.cat([head.tokens, tokens], dim=1), draft_len=lengths + width, hidden=head.hidden,
                 hidden_layer=exit_layer, parents=torch.cat([head_parents, parents], dim=1))


def _ngram_draft(view: DraftView, tokens, length) -> Draft:
    width = int(length.max())
    if width == 0:
        return Draft.empty(view.batch, view.device)
    return Draft(tokens=tokens[:, :width], draft_len=length)


def _mixed_q(tokens, head_q, vocab: int):
    """(B, w, V) draft distribution: one-hot on forced tokens, the head's probabilities where a row took its token."""
    q = torch.nn.functional.one_hot(tokens, vocab).float()
    for col, take, probs in head_q:
        if col < tokens.shape[1]:
            q[:, col] = torch.where(take[:, None], probs, q[:, col])
    return q


def from_engine(engine) -> HybridChainDrafter:
    """The registry's factory for drafter="hybrid": the tree hybrid where the config drafts trees."""
    cfg = engine.config
    early = EarlyExitDrafter.from_engine(engine)
    cls = HybridTreeDrafter if cfg.draft_tree_top_k > 1 else HybridChainDrafter
    return cls(early, NgramDrafter.of(cfg), HybridPolicy.of(cfg))
