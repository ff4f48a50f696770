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


def utf8_text(raw: bytes, name) -> str:
    """The text of a file's bytes; bytes that are not UTF-8 are refused naming the file (a ValueError: the CLI's
    one line)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} is not UTF-8 text (byte {err.start}: {err.reason}). Fix: save it as UTF-8.") from None


def read_text(path: Path) -> str:
    return utf8_text(Path(path).read_bytes(), path)


def jsonl_rows(text: str, name: str, fix: str):
    """(line number, decoded value) for each non-blank line of a JSONL file's text; a line that is not JSON raises
    ValueError naming `name`:line and ending with `fix`, the one sentence that says what the line should hold."""
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{name}:{n}: not JSON ({err.msg} at column {err.colno}). Fix: {fix}") from None


PROMPT_LINE = 'make each line one JSON object with a non-empty "turns" list of strings, {"turns": ["Hi"]}.'


def _read(source: Path) -> list[Prompt]:
    text = read_text(source)
    lines = [line for line in text.splitlines() if line.strip()]
    if source.suffix == ".jsonl" or (lines and lines[0].lstrip().startswith("{")):
        out = []
        for n, row in jsonl_rows(text, str(source), PROMPT_LINE):
            turns = row.get("turns") if isinstance(row, dict) else None
            if not turns or not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{source}:{n}: expected a JSON object with a non-empty 'turns' list of strings. "
                                 f"Fix: {PROMPT_LINE}")
            out.append(Prompt(row["turns"][0], row.get("category", "custom"), row.get("question_id"),
                              tuple(row["turns"])))
        return out
    return [Prompt(line) for line in lines]


def chat_input_ids(tokenizer, text: str):
    """(1, T) ids of one user turn, rendered by selfspec.chat (the chat template, or plain dialogue without one)."""
    return conversation_ids(tokenizer, [{"role": "user", "content": text}])


def conversation_ids(tokenizer, messages: list[dict]):
    """(1, T) ids of a conversation ending with a user turn ({"role", "content"} dicts) and the answer's header,
    rendered by selfspec.chat."""
    import torch

    from .chat import encode

    return torch.tensor([encode(tokenizer, messages)], dtype=torch.long)


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
