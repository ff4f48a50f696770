"""Logits processors applied with the right prefix for every row and position.

Hugging Face processors read `(input_ids, scores)`. Speculation scores several positions per row at once, and
rows sit at different lengths, so position j of row b must see exactly the tokens HF's own loop would have shown
it: row b's sequence up to its length plus the j tokens drafted before. Processors that never read input_ids
(temperature, top-k, top-p, ...) run once over all positions; the rest run per group of rows of equal length.
"""
from __future__ import annotations

import copy

import torch
from transformers import LogitsProcessorList
from transformers.generation import logits_process as lp

_PREFIX_FREE = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
        "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "LogitNormalization",
        "InfNanRemoveLogitsProcessor", "SuppressTokensLogitsProcessor",
    )
    if hasattr(lp, name)
)

# Hugging Face processors that keep state between calls or call back into user code: speculation calls a
# processor on drafts that are later rejected and on several positions per step, so these cannot run inside it.
_STATEFUL_HF = tuple(
    getattr(lp, name)
    for name in (
        "UnbatchedClassifierFreeGuidanceLogitsProcessor", "ClassifierFreeGuidanceLogitsProcessor",
        "PrefixConstrainedLogitsProcessor", "WhisperTimeStampLogitsProcessor", "WhisperNoSpeechDetection",
    )
    if hasattr(lp, name)
)
# A processor of one's own declares itself a pure function of (input_ids, scores), safe to call on any prefix in
# any order, with this attribute; without it selfspec cannot know and runs the plain generate instead.
PURE_ATTRIBUTE = "selfspec_pure"


def is_pure(processor) -> bool:
    """Whether a logits processor's output depends only on (input_ids, scores) of the call."""
    declared = getattr(processor, PURE_ATTRIBUTE, None)
    if declared is not None:
        return bool(declared)
    own = type(processor).__module__ == lp.__name__  # Hugging Face's own processors read only their arguments
    return own and not isinstance(processor, _STATEFUL_HF)


def impure_processor_reason(processors) -> str | None:
    """Why these user processors cannot run speculatively, or None."""
    names = [type(p).__name__ for p in (processors or []) if not is_pure(p)]
    if not names:
        return None
    return (f"logits processor(s) {', '.join(names)} may keep state between calls, and speculation calls them on "
            f"drafts that are later rejected (set `{PURE_ATTRIBUTE} = True` on a processor whose output depends only "
            f"on its (input_ids, scores) arguments to let it run speculatively)")


# Processors holding one value per batch row (HF sets the repetition penalty's per-row padding length, so that
# left padding is not penalised): a call on a subset of rows needs those values sliced to the same rows.
_PER_ROW_ATTRS = {lp.RepetitionPenaltyLogitsProcessor: ("prompt_ignore_length",)}


def _for_rows(processors: LogitsProcessorList, rows: torch.Tensor, batch: int) -> LogitsProcessorList:
    out = LogitsProcessorList()
    for proc in processors:
        names = [n for n in _PER_ROW_ATTRS.get(type(proc), ())
                 if isinstance(getattr(proc, n, None), torch.Tensor) and getattr(proc, n).shape[0] == batch]
        if names:
            proc = copy.copy(proc)
            for n in names:
                setattr(proc, n, getattr(proc, n).to(rows.device)[rows])
        out.append(proc)
    return out


class PrefixProcessor:
    """Wraps a LogitsProcessorList; `__call__` processes (B, T, V) logits where position j of row b follows
    the prefix seq[b, :lengths[b] + j]."""

    def __init__(self, processors: LogitsProcessorList | None):
        self.processors = LogitsProcessorList(processors or [])
        self.prefix_free = all(isinstance(p, _PREFIX_FREE) for p in self.processors)

    def __bool__(self) -> bool:
        return len(self.processors) > 0

    def __call__(self, seq: torch.Tensor, lengths: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """seq: (B, S) token buffer; lengths: (B,) tokens valid before position 0; logits: (B, T, V) float32."""
        if not self.processors:
            return logits
        b, t, v = logits.shape
        if self.prefix_free:
            dummy = seq[:, :1].repeat_interleave(t, dim=0)  # these processors ignore input_ids
            return self.processors(dummy, logits.reshape(b * t, v).clone()).view(b, t, v)
        out = torch.empty_like(logits)
        for j in range(t):
            groups = _rows_by_length(lengths + j)
            if len(groups) == 1:  # every row at the same length: one call, exactly as HF's loop makes it
                out[:, j] = self.processors(seq[:, : groups[0][0]], logits[:, j].clone())
                continue
            for length, rows in groups:
                out[rows, j] = _for_rows(self.processors, rows, b)(seq[rows, :length], logits[rows, j].clone())
        return out


def _rows_by_length(lengths: torch.Tensor):
    """Group row indices by their prefix length: [(length, LongTensor rows), ...]."""
    values = lengths.tolist()
    groups: dict[int, list[int]] = {}
    for row, length in enumerate(values):
        groups.setdefault(length, []).append(row)
    return [(length, torch.tensor(rows, device=lengths.device)) for length, rows in groups.items()]
