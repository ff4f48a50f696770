"""A small byte-level BPE tokenizer built offline, for tests that need a real tokenizer (stop strings, streamers,
chat templates, pipelines) without the SmolLM2 package.

Its vocabulary is printable ASCII, space and newline (every token decodes to valid text, so stop strings and
streamed text compare cleanly) plus a few merges, so that some tokens span several characters and a stop string
can start or end inside a token."""
from __future__ import annotations

SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]  # pad 0, bos 1, eos 2
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ġ", "a"), ("o", "n"), ("Ġ", "w")]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_char(b: int) -> str:
    """GPT-2's byte -> unicode map for the bytes used here: printable ASCII maps to itself, space to 'Ġ',
    newline to 'Ċ'."""
    return chr(b) if 33 <= b <= 126 else chr(256 + b)


def tiny_tokenizer(extra_tokens: list[str] | None = None):
    """A PreTrainedTokenizerFast of about 110 tokens with pad, bos, eos and a chat template.

    extra_tokens: appended to the vocabulary (as plain tokens), to build a tokenizer that differs from the default
    one only there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [_byte_char(10), _byte_char(32)] + [chr(b) for b in range(33, 127)]
    tokens = SPECIALS + chars + ["".join(m) for m in MERGES] + list(extra_tokens or [])
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.padding_side = "left"
    return tok
