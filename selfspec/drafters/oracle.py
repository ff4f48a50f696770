"""A drafter that proposes the true continuation, known in advance (the benchmark's upper bound).

Given each row's reference output (for greedy decoding: the plain model's greedy tokens), it proposes the next
k reference tokens at every step, so every draft is accepted and each verify pass emits k + 1 tokens. It costs no
compute of its own, so its speed is the best any drafter can reach at this draft length on this device.
"""
from __future__ import annotations

import torch

from .base import Draft, Drafter


def pad_targets(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row token lists -> (B, N) right-padded tensor and (B,) lengths."""
    width = max((len(r) for r in rows), default=0)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for b, row in enumerate(rows):
        targets[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return targets, torch.tensor([len(r) for r in rows], dtype=torch.long)


class OracleDrafter(Drafter):
    """Proposes `targets[b, g : g + k]` where g is how many tokens row b has generated so far.

    targets: (B, N) reference continuation of each row (right-padded); lengths: (B,) valid tokens per row.
    Once a row's output leaves the reference (it never does for greedy), the proposals are simply rejected.
    """

    name = "oracle"

    def __init__(self, targets: torch.Tensor, lengths: torch.Tensor):
        if targets.dim() != 2 or lengths.shape != targets.shape[:1]:
            raise ValueError(f"OracleDrafter needs targets (B, N) and lengths (B,), got {tuple(targets.shape)} "
                             f"and {tuple(lengths.shape)}.")
        self.targets, self.lengths = targets.long(), lengths.long()

    @classmethod
    def from_rows(cls, rows: list[list[int]]) -> "OracleDrafter":
        return cls(*pad_targets(rows))

    def begin(self, view, prompt) -> None:
        if view.batch != self.targets.shape[0]:
            raise ValueError(f"OracleDrafter holds {self.targets.shape[0]} reference rows but the batch has "
                             f"{view.batch}; build it from the outputs of this very batch.")
        self.targets = self.targets.to(view.device)
        self.lengths = self.lengths.to(view.device)

    def propose(self, view, k: int) -> Draft:
        generated = view.seq_len - view.prompt_len  # (B,) tokens emitted so far, the pending one included
        draft_len = (self.lengths - generated).clamp(0, k).masked_fill(view.finished, 0)
        width = int(draft_len.max()) if k else 0
        if width == 0:
            return Draft.empty(view.batch, view.device)
        cols = (generated[:, None] + torch.arange(width, device=view.device)).clamp(max=self.targets.shape[1] - 1)
        return Draft(tokens=self.targets.gather(1, cols), draft_len=draft_len)  # columns past draft_len: ignored


def from_engine(engine) -> Drafter:
    """Registry entry: the oracle needs the reference output, which only the caller has."""
    raise ValueError("The oracle drafter proposes a known reference continuation, so it cannot be built from a "
                     "config: set `model.selfspec.drafter_override = OracleDrafter.from_rows(reference_rows)` "
                     "after wrapping (selfspec bench does this).")
