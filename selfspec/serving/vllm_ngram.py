"""selfspec's prompt lookup as a vLLM proposer (`speculative_config={"method": "custom_class", ...}`).

vLLM builds the class from its config and calls `propose` once per engine step with the token ids of every
running request; the proposer returns up to k draft tokens per request (an empty list: no draft). The lookup is
selfspec's own (drafters/ngram.py): the longest of the request's last ngram_max ... ngram_min tokens that occurred
before, continued from its most recent occurrence. It sees token ids only, as every custom_class proposer does.

    LLM(model=..., speculative_config={"method": "custom_class",
                                       "model": "selfspec.serving.vllm_ngram.NgramProposer",
                                       "num_speculative_tokens": 8})

Each request's draft length follows its own acceptance, as transformers' assisted generation schedules its
assistant ("heuristic"): two more tokens after a step that accepted the whole draft, one fewer after one that did
not, between 1 and k. A verify pass costs more per token on a CPU than prompt lookup's drafts are worth where
they keep failing, and a copying request runs at full length. `NgramProposer.ngram_max` / `ngram_min` default to
the shipped calibration's; a subclass changes them, and `adaptive = False` drafts k whenever there is a match.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..lookup import PAD, continuation, suffix_match


def propose_rows(texts: list[np.ndarray], k: int, ngram_max: int, ngram_min: int) -> list[list[int]]:
    """Prompt lookup over a batch of token-id rows of different lengths -> up to k draft tokens per row."""
    if not texts:
        return []
    width = max(len(t) for t in texts)
    text = torch.full((len(texts), width), PAD, dtype=torch.long)  # (B, L), PAD past a row's end
    for row, tokens in enumerate(texts):
        text[row, :len(tokens)] = torch.from_numpy(np.asarray(tokens, dtype=np.int64))
    last = torch.tensor([len(t) - 1 for t in texts])  # (B,)
    match, end = suffix_match(text, last, ngram_max, ngram_min)
    tokens, length = continuation(text, last, match, end, k)  # (B, k), (B,)
    return [tokens[row, :length[row]].tolist() for row in range(len(texts))]


@dataclass
class _Request:
    """What the proposer remembers of the request in one batch row: enough to know it again next step."""

    length: int  # its tokens when it was last drafted for
    tail: tuple  # its last tokens then
    drafted: int  # tokens drafted for it then
    budget: int  # its draft length now


class NgramProposer:
    """vLLM's custom_class contract: built as `NgramProposer(vllm_config)`, asked for drafts by `propose`."""

    ngram_max = 3
    ngram_min = 1
    adaptive = True
    _TAIL = 8  # tokens that recognise a row's request from one step to the next

    def __init__(self, vllm_config):
        spec = vllm_config.speculative_config
        self.k = spec.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.requests: dict[int, _Request] = {}  # batch row -> its request's schedule

    def budget(self, row: int, text: np.ndarray, sampled: list[int]) -> int:
        """Row's draft length this step, from how its previous draft fared (`sampled`: the tokens the last step
        accepted for it, the target's own last). vLLM gives rows, not request ids, and moves requests between rows
        as others finish: a row whose text does not continue what it held starts a new schedule at k."""
        known = self.requests.get(row)
        if not self.adaptive or known is None or len(text) < known.length or \
                tuple(text[known.length - len(known.tail): known.length]) != known.tail:
            return self.k
        if not known.drafted:
            return known.budget
        accepted_all = len(sampled) - 1 >= known.drafted
        return min(self.k, known.budget + 2) if accepted_all else max(1, known.budget - 1)

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, slot_mappings=None) -> list[list[int]]:
        """Row i's text is token_ids_cpu[i, :num_tokens_no_spec[i]]; a row that sampled nothing this step (it is
        prefilling or paused) or has no room left gets no draft."""
        rows = [i for i, sampled in enumerate(sampled_token_ids)
                if sampled and num_tokens_no_spec[i] < self.max_model_len]
        texts = [token_ids_cpu[i, :num_tokens_no_spec[i]] for i in rows]
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        for i, text, draft in zip(rows, texts, propose_rows(texts, self.k, self.ngram_max, self.ngram_min)):
            budget = self.budget(i, text, sampled_token_ids[i])
            drafts[i] = draft[:min(budget, self.max_model_len - len(text))]
            self.requests[i] = _Request(len(text), tuple(text[-self._TAIL:].tolist()), len(drafts[i]), budget)
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        """No model: the lookup reads token ids only."""
