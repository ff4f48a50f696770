"""Prompt lookup: draft the continuation of the most recent earlier occurrence of each row's last n tokens.

No parameters and no forward pass. With draft trees (draft_tree_top_k > 1) the continuations of the top_k most
recent occurrences become the branches of a tree, merged where they share a prefix. Row b's text is
`view.seq[b, :view.seq_len[b]]` (its prompt, then what it generated) with the prompt's padding ignored. For n
from `ngram_max` down to `ngram_min`, the row's last n tokens are looked up in that text; the first n that has a
match wins, and the drafted tokens are the up to k tokens that followed its most recent occurrence. The draft is a
point mass (Draft.q = None) and brings no hidden states (Draft.hidden = None): the verifier runs every layer over
the drafted positions.

The lookup is vectorised over the batch and the suffix offsets: one (B, ngram_max, S) comparison against shifted
views of the text, so a step costs O(B * S * ngram_max) elementwise work in a fixed handful of ops and no per-row
Python. A copy head looks up once per drafted token, where that handful of ops would cost more than the rest of
the head, so it keeps a SuffixIndex of each row's text on the host instead (the same rule, in lookup.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..lookup import PAD, continuation, cut_after_eos, suffix_match, suffix_matches
from ..trees import merge_branches, pack_trees
from .base import Draft, Drafter

@dataclass
class NgramProposal:
    tokens: torch.Tensor  # (B, k) continuation tokens; columns past `length` hold the row's last token
    length: torch.Tensor  # (B,) usable tokens per row, 0 when the row has no match
    match: torch.Tensor  # (B,) length n of the matched suffix, 0 when none


def strong_only(branches: list, match: list[int], min_match: int) -> list:
    """[row] branches (matched_branches' first value) with none left for rows whose match is shorter than
    min_match."""
    return [b if m >= min_match else [] for b, m in zip(branches, match)]


def branch_draft(view, tokens: torch.Tensor, parents: torch.Tensor, draft_len: torch.Tensor) -> Draft:
    """Packed n-gram trees (trees.pack_trees: (B, N) tokens and parents, (B,) nodes per row) as a tree draft with no
    hidden states, so the verifier runs every layer over it; empty when no row has a node."""
    if tokens.shape[1] == 0:
        return Draft.empty(view.batch, view.device)
    return Draft(tokens=tokens, draft_len=draft_len, parents=parents)


@dataclass(frozen=True)
class NgramSettings:
    """The lookup's settings: the longest and shortest suffix n-gram it matches."""

    ngram_max: int = 3
    ngram_min: int = 1
    FIELDS: ClassVar[tuple] = ("ngram_max", "ngram_min")  # the config fields it is read from

    def __post_init__(self):
        if not all(type(n) is int for n in (self.ngram_max, self.ngram_min)) \
                or not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need integers 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min!r}, "
                             f"ngram_max={self.ngram_max!r}.")

    @staticmethod
    def of(config) -> "NgramSettings":
        return NgramSettings(config.ngram_max, config.ngram_min)


class NgramDrafter(Drafter):
    name = "ngram"
    drafts_trees = True  # with trees: the continuations of several earlier occurrences, as branches

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        NgramSettings(ngram_max, ngram_min)  # raises naming the bad values
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.prompt_pad: torch.Tensor | None = None  # (B, T0) True where the prompt is padding

    @classmethod
    def of(cls, config) -> "NgramDrafter":
        settings = NgramSettings.of(config)
        return cls(settings.ngram_max, settings.ngram_min)

    def begin(self, view, prompt) -> None:
        mask = view.mask
        self.prompt_pad = None if mask is None else (mask == 0)

    def text_of(self, view, drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) tokens of every row up to the longest, padding replaced by PAD; (B,) index of last tokens. With
        (B, w) `drafts`, each row's text goes on through them (view.text_with)."""
        drafted = 0 if drafts is None else drafts.shape[1]
        length = max(view.lengths) + drafted  # host copy: no device sync
        text = (view.seq if drafts is None else view.text_with(drafts))[:, :length]
        if self.prompt_pad is not None and bool(self.prompt_pad.any()):
            pad = torch.nn.functional.pad(self.prompt_pad, (0, length - self.prompt_pad.shape[1]), value=False)
            text = text.masked_fill(pad[:, :length], PAD)
        return text, view.seq_len - 1 + drafted

    def lookup(self, view, k: int, drafts: torch.Tensor | None = None) -> NgramProposal:
        """The n-gram continuation for every row (length 0 for finished rows and rows without a match); with (B, w)
        `drafts`, of each row's text followed by them, as if they were verified."""
        text, last = self.text_of(view, drafts)
        match, end = suffix_match(text, last, self.ngram_max, self.ngram_min)
        match = match.masked_fill(view.finished, 0)
        tokens, length = continuation(text, last, match, end, k)
        return NgramProposal(tokens, cut_after_eos(tokens, length, view.is_eos), match)

    def branches(self, view, k: int, count: int, min_match: int = 1) -> list[list[list[int]]]:
        """[row][branch] the continuations (up to k tokens, cut after an EOS) of the `count` most recent
        occurrences of each row's longest matched suffix, most recent first; none for finished rows and rows
        whose match is shorter than min_match."""
        return strong_only(*self.matched_branches(view, k, count), min_match)

    def matched_branches(self, view, k: int, count: int) -> tuple[list[list[list[int]]], list[int]]:
        """branches() of every match, however short, and each row's match length (0: none, or finished)."""
        text, last = self.text_of(view)
        match, ends = suffix_matches(text, last, self.ngram_max, self.ngram_min, count)
        match = match.masked_fill(view.finished, 0)
        chains = []
        for c in range(count):
            found = match.masked_fill(ends[:, c] < 0, 0)
            tokens, length = continuation(text, last, found, ends[:, c].clamp(min=0), k)
            chains.append((tokens, cut_after_eos(tokens, length, view.is_eos)))
        tokens = torch.stack([t for t, _ in chains], dim=1).tolist()  # (B, count, k)
        lengths = torch.stack([n for _, n in chains], dim=1).tolist()
        branches = [[row[c][: n[c]] for c in range(count) if n[c]] for row, n in zip(tokens, lengths)]
        return branches, match.tolist()

    def propose_tree(self, view, k: int) -> Draft:
        """The branches of every row merged into a trie of at most tree_size nodes (no hidden views: the verifier
        runs every layer over them)."""
        trees = [merge_branches(b, view.settings.tree_size)
                 for b in self.branches(view, k, view.settings.tree_top_k)]
        return branch_draft(view, *pack_trees(trees, view.device))

    def propose(self, view, k: int) -> Draft:
        if k == 0:
            return Draft.empty(view.batch, view.device)
        if view.settings.tree_top_k > 1:
            return self.propose_tree(view, k)
        found = self.lookup(view, k)
        width = int(found.length.max())
        if width == 0:
            return Draft.empty(view.batch, view.device)
        return Draft(tokens=found.tokens[:, :width], draft_len=found.length)
