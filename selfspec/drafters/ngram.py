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
the head, so it keeps a SuffixIndex of each row's text on the host instead (the same rule).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trees import merge_branches, pack_trees
from .base import Draft, Drafter

_PAD = -1  # stands in for prompt padding: never equal to a real token
_SHIFT_FILL = -2  # fills the left edge of shifted copies: equal to neither a token nor _PAD


@dataclass
class NgramProposal:
    tokens: torch.Tensor  # (B, k) continuation tokens; columns past `length` hold the row's last token
    length: torch.Tensor  # (B,) usable tokens per row, 0 when the row has no match
    match: torch.Tensor  # (B,) length n of the matched suffix, 0 when none


def suffix_match(text: torch.Tensor, last: torch.Tensor, n_max: int, n_min: int):
    """Longest suffix match per row, most recent occurrence first.

    text: (B, L) tokens with _PAD where a row has no token; last: (B,) index of each row's last token.
    Returns (match (B,), end (B,)): the suffix length n matched (0 if none) and the index in `text` where the
    earlier occurrence ends (it ends before `last`, so at least one token follows it)."""
    match, ends = suffix_matches(text, last, n_max, n_min, 1)
    return match, ends[:, 0].clamp(min=0)


def suffix_matches(text: torch.Tensor, last: torch.Tensor, n_max: int, n_min: int, count: int):
    """Like suffix_match, with the `count` most recent occurrences of the longest matched suffix: (match (B,),
    ends (B, count)), most recent first, -1 where a row has fewer."""
    length = text.shape[1]
    idx = torch.arange(length, device=text.device)[None, :]  # (1, L)
    d = torch.arange(n_max, device=text.device)[None, :]  # (1, n): suffix offsets
    suffix_tok = text.gather(1, (last[:, None] - d).clamp(min=0))  # (B, n): the row's last n tokens, newest first
    suffix_ok = (last[:, None] - d >= 0) & (suffix_tok != _PAD)
    # shifted[:, d, e] = text[:, e - d]: views of one left-padded copy (past the left edge: fill, matching nothing)
    padded = torch.nn.functional.pad(text, (n_max - 1, 0), value=_SHIFT_FILL)
    shifted = padded.unfold(1, length, 1).flip(1)  # (B, n, L)
    same = (shifted == suffix_tok[..., None]) & suffix_ok[..., None]  # (B, n, L)
    # run[:, d, e]: the d + 1 tokens ending at e equal the row's last d + 1 (a cumulative AND over offsets), with
    # the occurrence ending before the suffix's own last token
    run = same.to(torch.uint8).cumprod(dim=1).bool() & (idx < last[:, None])[:, None, :]
    hit = run.any(dim=2) & (d + 1 >= n_min)  # (B, n)
    match = torch.where(hit, d + 1, 0).amax(dim=1)  # the longest suffix with an occurrence; 0: none
    best = run.gather(1, (match - 1).clamp(min=0)[:, None, None].expand(-1, 1, length))[:, 0] & (match > 0)[:, None]
    ends = torch.where(best, idx, -1).topk(min(count, length), dim=1).values  # most recent (largest) first
    if ends.shape[1] < count:
        ends = torch.nn.functional.pad(ends, (0, count - ends.shape[1]), value=-1)
    return match, ends


def continuation(text: torch.Tensor, last: torch.Tensor, match: torch.Tensor, end: torch.Tensor, k: int):
    """Up to k tokens after each row's match end: (tokens (B, k), length (B,))."""
    j = torch.arange(k, device=text.device)[None, :]
    where = torch.minimum(end[:, None] + 1 + j, last[:, None])
    length = torch.minimum(last - end, torch.full_like(last, k)).masked_fill(match == 0, 0)
    # columns past a row's length still go through the verifier: give them the row's last token, never _PAD
    where = torch.where(j < length[:, None], where, last[:, None])
    return text.gather(1, where), length


class SuffixIndex:
    """A growing text's copy candidates on the host: where each n-gram (n <= n_max) last ended, so that a copy
    head's candidate (the token after the most recent earlier occurrence of the text's longest suffix of n <= n_max
    tokens that has one) costs a dict lookup per n, not a pass over the text. The rule is suffix_match's, which the
    n-gram drafter vectorises over a batch (tests hold the two together); _PAD (prompt padding) never matches.

    The text is verified tokens, indexed as they come (`extend`); a lookup may add a path of drafts after them,
    which is searched but never indexed, so a rejected draft leaves nothing behind."""

    def __init__(self, n_max: int):
        self.n_max, self.tokens = n_max, []
        self.last_end = [dict() for _ in range(n_max + 1)]  # [n][n tokens] -> their latest end, before the last

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self._index_end(len(self.tokens) - 1)  # the n-grams ending at the old last token are now earlier ones
            self.tokens.append(token)

    def _index_end(self, t: int) -> None:
        for n in range(1, min(self.n_max, t + 1) + 1):
            gram = tuple(self.tokens[t - n + 1 : t + 1])
            if gram[0] == _PAD:  # longer n-grams hold the padding too
                break
            self.last_end[n][gram] = t

    def candidate(self, path: tuple = ()) -> tuple[int, int]:
        """(token, match) for the text followed by `path`: token -1 and match 0 where no suffix occurs earlier."""
        size = len(self.tokens)

        def at(i: int) -> int:
            return self.tokens[i] if i < size else path[i - size]

        last = size + len(path) - 1
        for n in range(min(self.n_max, last + 1), 0, -1):
            gram = tuple(at(i) for i in range(last - n + 1, last + 1))
            if _PAD in gram:
                continue
            # ends the index does not hold yet: the text's last token and the path, most recent first
            for end in range(last - 1, max(size - 2, n - 2), -1):
                if all(at(end - i) == gram[n - 1 - i] for i in range(n)):
                    return at(end + 1), n
            end = self.last_end[n].get(gram)
            if end is not None:
                return at(end + 1), n
        return -1, 0


def prefix_copy_candidates(tokens: list[int], n_max: int) -> tuple[list[int], list[int]]:
    """A copy head's candidate for every prefix tokens[:t + 1] of one text at once, for training and replay:
    -> (token, match) lists of len(tokens); token -1 where none."""
    index, out_tok, out_match = SuffixIndex(n_max), [], []
    for token in tokens:
        index.extend([token])
        tok, match = index.candidate()
        out_tok.append(tok)
        out_match.append(match)
    return out_tok, out_match


def cut_after_eos(tokens: torch.Tensor, length: torch.Tensor, is_eos) -> torch.Tensor:
    """Nothing is drafted after an EOS: (B,) lengths cut to end at a row's first drafted EOS, if any."""
    j = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
    stop = is_eos(tokens) & (j < length[:, None])
    first = torch.where(stop.any(1), stop.long().argmax(1) + 1, length)
    return torch.minimum(length, first)


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


class NgramDrafter(Drafter):
    name = "ngram"
    drafts_trees = True  # with trees: the continuations of several earlier occurrences, as branches

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got ngram_min={ngram_min}, ngram_max={ngram_max}.")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.prompt_pad: torch.Tensor | None = None  # (B, T0) True where the prompt is padding

    def begin(self, view) -> None:
        mask = view.mask
        self.prompt_pad = None if mask is None else (mask == 0)

    def text_of(self, view, drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) tokens of every row up to the longest, padding replaced by _PAD; (B,) index of last tokens. With
        (B, w) `drafts`, each row's text goes on through them (view.text_with)."""
        drafted = 0 if drafts is None else drafts.shape[1]
        length = max(view.lengths) + drafted  # host copy: no device sync
        text = (view.seq if drafts is None else view.text_with(drafts))[:, :length]
        if self.prompt_pad is not None and bool(self.prompt_pad.any()):
            pad = torch.nn.functional.pad(self.prompt_pad, (0, length - self.prompt_pad.shape[1]), value=False)
            text = text.masked_fill(pad[:, :length], _PAD)
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
