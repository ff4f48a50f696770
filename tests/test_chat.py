"""One rule turns a conversation into model input (selfspec.chat): the tokenizer's chat template where it has one,
plain User: / Assistant: dialogue where it has none (said once), used by every stage that renders chats."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from selfspec import chat
from selfspec.prompts import Prompt, chat_input_ids, conversation_ids
from tiny_tokenizer import tiny_tokenizer

CHAT = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "A pear."},
        {"role": "user", "content": "Another one?"}]


@pytest.fixture
def base():
    tok = tiny_tokenizer()
    tok.chat_template = None
    tok.name_or_path = f"base-{id(tok)}"  # a name of its own, so that it is told about once in this test
    return tok


def test_a_template_renders_as_hugging_face_does():
    tok = tiny_tokenizer()
    want = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert chat.encode(tok, CHAT) == list(want)
    assert conversation_ids(tok, CHAT)[0].tolist() == list(want)


def test_without_a_template_chats_are_plain_dialogue_said_once(base, capsys):
    text = chat.render(base, CHAT)
    assert text == "User: Name a fruit.\n\nAssistant: A pear.\n\nUser: Another one?\n\nAssistant:"
    assert chat.encode(base, CHAT) == base(text)["input_ids"]
    chat_input_ids(base, "Again.")
    assert capsys.readouterr().err.count("has no chat template") == 1


def test_plain_dialogue_can_be_asked_for_where_a_template_exists():
    tok = tiny_tokenizer()
    assert chat.render(tok, CHAT[:1], template=False) == "User: Name a fruit.\n\nAssistant:"


def test_a_role_plain_dialogue_has_no_name_for_is_refused(base):
    with pytest.raises(ValueError, match=r"chat roles \['tool'\] have no plain-dialogue name"):
        chat.render(base, [{"role": "tool", "content": "{}"}])


def test_the_bench_and_the_collection_render_a_base_models_prompts_alike(base):
    """The bench's prompt, a calibration prompt and an on-policy collection prompt are the same ids."""
    from selfspec.tools.bench import encode
    from selfspec.training.answers import Job, encode_prompts

    job = Job(0, "sharegpt", 1, 0, [{"role": "user", "content": "Name a fruit."}])
    encode_prompts(base, [job])
    assert job.prompt_ids == encode(base, Prompt("Name a fruit."), True) == chat_input_ids(base, "Name a fruit.")[
        0].tolist()


def test_no_module_but_chat_calls_apply_chat_template():
    root = Path(chat.__file__).parent
    callers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if p.name != "chat.py" and re.search(r"\.apply_chat_template\(", p.read_text())]
    assert callers == []
