"""Prompt lookup's rule, shared by every user of it: the n-gram drafter (vectorised over a batch), a copy head's
candidate (SuffixIndex, on the host, one lookup per draft), the cost model's replay and vLLM's lookup drafter.

For n from n_max down to n_min, a text's last n tokens are looked up in the text before them; the first n with an
earlier occurrence wins, and what followed its most recent occurrence is the continuation. PAD (prompt padding)
never matches.
"""
from __future__ import annotations

import torch

PAD = -1  # stands in for prompt padding: never equal to a real token
_SHIFT_FILL = -2  # fills the left edge of shifted copies: equal to neither a token nor PAD


def suffix_match(text: torch.Tensor, last: torch.Tensor, n_max: int, n_min: int):
    """Longest suffix match per row, most recent occurrence first.

    text: (B, L) tokens with PAD where a row has no token; last: (B,) index of each row's last token.
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
    suffix_ok = (last[:, None] - d >= 0) & (suffix_tok != PAD)
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
    # columns past a row's length still go through the verifier: give them the row's last token, never PAD
    where = torch.where(j < length[:, None], where, last[:, None])
    return text.gather(1, where), length


class SuffixIndex:
    """A growing text's copy candidates on the host: where each n-gram (n <= n_max) last ended, so that a copy
    head's candidate (the token after the most recent earlier occurrence of the text's longest suffix of n <= n_max
    tokens that has one) costs a dict lookup per n, not a pass over the text. The rule is suffix_match's, which the
    n-gram drafter vectorises over a batch (tests hold the two together); PAD (prompt padding) never matches.

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
            if gram[0] == PAD:  # longer n-grams hold the padding too
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
            if PAD in gram:
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
