"""Prompt sets: Spec-Bench questions (shipped in the package, Apache-2.0) and users' own files.

The project's split: train and calibrate on the eight MT-bench categories, evaluate on the other five.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

TRAIN_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
EVAL_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass
class Prompt:
    text: str  # the first user turn
    category: str = "custom"
    question_id: str | int | None = None
    turns: tuple = ()


def spec_bench_path() -> Path:
    return Path(str(resources.files("selfspec") / "assets" / "spec_bench" / "question.jsonl"))


def load_prompts(path: str | Path | None = None, split: str = "eval", categories=None,
                 limit_per_category: int | None = None) -> list[Prompt]:
    """Spec-Bench (default) or a user's file: JSONL with `turns` (first turn used) or plain text, one prompt a line.

    split: "eval" or "train" selects Spec-Bench categories unless `categories` names them.
    """
    if split not in ("eval", "train", "all"):
        raise ValueError(f"split must be 'eval', 'train' or 'all', got {split!r}.")
    source = Path(path) if path is not None else spec_bench_path()
    if not source.is_file():
        raise FileNotFoundError(f"No prompt file at {str(source)!r}.")
    prompts = _read(source)
    if categories is None and path is None:
        categories = {"eval": EVAL_CATEGORIES, "train": TRAIN_CATEGORIES, "all": None}[split]
    if categories is not None:
        unknown = set(categories) - {p.category for p in prompts}
        if unknown:
            raise ValueError(f"No prompts of categories {sorted(unknown)} in {source.name}.")
        prompts = [p for p in prompts if p.category in set(categories)]
    if limit_per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= limit_per_category:
                kept.append(p)
        prompts = kept
    return prompts


def _read(source: Path) -> list[Prompt]:
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    if source.suffix == ".jsonl" or (lines and lines[0].lstrip().startswith("{")):
        out = []
        for n, line in enumerate(lines, 1):
            row = json.loads(line)
            if not row.get("turns"):
                raise ValueError(f"{source}:{n}: expected a JSON object with a non-empty 'turns' list.")
            out.append(Prompt(row["turns"][0], row.get("category", "custom"), row.get("question_id"),
                              tuple(row["turns"])))
        return out
    return [Prompt(line) for line in lines]


def chat_input_ids(tokenizer, text: str):
    """(1, T) ids of one user turn with the tokenizer's chat template (plain text if it has none)."""
    return conversation_ids(tokenizer, [{"role": "user", "content": text}])


def conversation_ids(tokenizer, messages: list[dict]):
    """(1, T) ids of a conversation ending with a user turn ({"role", "content"} dicts), with the tokenizer's chat
    template and a generation prompt (without a template: the turns' texts joined by blank lines)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer("\n\n".join(m["content"] for m in messages), return_tensors="pt")["input_ids"]


def left_pad(rows: list[list[int]], pad_id: int):
    """Token lists -> (B, T) ids left-padded with pad_id and their (B, T) attention mask, as a batched `generate`
    takes prompts of different lengths."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[b, width - len(row):] = 1
    return ids, mask
