"""Conversations -> model input: the one rule every stage uses (collection, calibration, the bench, generate).

A tokenizer with a chat template renders chats with it. One without (a base model) renders them as plain dialogue,
"User: ...", "Assistant: ..." paragraphs ending in the header of the answer to come, and says so once per
tokenizer. Nothing else in selfspec calls `apply_chat_template`.
"""
from __future__ import annotations

import sys

ROLES = {"system": "System", "user": "User", "assistant": "Assistant"}
_TOLD: set[str] = set()  # tokenizers already reported as rendering plain dialogue


def has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def plain_dialogue(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """`messages` ({"role", "content"} dicts) as plain text; with `add_generation_prompt` the answer's header."""
    unknown = sorted({m["role"] for m in messages} - set(ROLES))
    if unknown:
        raise ValueError(f"chat roles {unknown} have no plain-dialogue name; use {', '.join(ROLES)}.")
    text = "".join(f"{ROLES[m['role']]}: {m['content']}\n\n" for m in messages)
    return text + ("Assistant:" if add_generation_prompt else "")


def _tell_once(tokenizer) -> None:
    name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
    if name not in _TOLD:
        _TOLD.add(name)
        print(f"selfspec: {name}'s tokenizer has no chat template: chats are rendered as plain dialogue "
              "(User: / Assistant:)", file=sys.stderr, flush=True)


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True, template: bool | None = None) -> str:
    """A chat as text. template None: the tokenizer's chat template where it has one, else plain dialogue;
    False: plain dialogue in any case."""
    if template is None:
        template = has_template(tokenizer)
    if template:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    _tell_once(tokenizer)
    return plain_dialogue(messages, add_generation_prompt)


def encode_text(tokenizer, text: str, first: bool = True, template: bool | None = None) -> list[int]:
    """Token ids of rendered chat text. A chat template writes its own special tokens; plain dialogue gets the
    tokenizer's (a BOS where it adds one) at the start of a sequence (`first`) only."""
    if template is None:
        template = has_template(tokenizer)
    if not text:
        return []
    return tokenizer(text, add_special_tokens=first and not template)["input_ids"]


def encode(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
           template: bool | None = None) -> list[int]:
    """Token ids of a chat, as the model reads it before answering (render, then encode_text)."""
    return encode_text(tokenizer, render(tokenizer, messages, add_generation_prompt, template), True, template)


def user_turn(tokenizer, text: str, template: bool | None = None) -> list[int]:
    """Token ids of one user turn and the answer's header."""
    return encode(tokenizer, [{"role": "user", "content": text}], True, template)
