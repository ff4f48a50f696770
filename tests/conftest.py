"""Small random models of every supported family, built from configs (no downloads)."""
from __future__ import annotations

import os

import pytest
import torch
import transformers as tf

VOCAB = 96

# SELFSPEC_TEST_DEVICE=cuda runs the tests on a GPU (scripts/device_check.sh): the models and every tensor a test
# builds without naming a device land there. Random prompts are still drawn on the CPU so that they are the same
# tokens on every device.
TEST_DEVICE = os.environ.get("SELFSPEC_TEST_DEVICE", "cpu")


def pytest_configure(config):
    if TEST_DEVICE != "cpu":
        torch.set_default_device(TEST_DEVICE)


@pytest.fixture
def on_cpu():
    """Runs a test of pure functions on the CPU whatever the test device: its draws come from a CPU generator (the
    same numbers on every device), which refuses to fill tensors that a default CUDA device would put on the GPU."""
    with torch.device("cpu"):
        yield


def _common(layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _llama_like(cfg_cls, model_cls, layers, **extra):
    cfg = cfg_cls(**_common(layers), intermediate_size=64, num_key_value_heads=2, **extra)
    return model_cls(cfg)


FAMILIES = {
    "llama": lambda L: _llama_like(tf.LlamaConfig, tf.LlamaForCausalLM, L),
    "mistral": lambda L: _llama_like(tf.MistralConfig, tf.MistralForCausalLM, L, sliding_window=6),
    "qwen2": lambda L: _llama_like(tf.Qwen2Config, tf.Qwen2ForCausalLM, L),
    "qwen3": lambda L: _llama_like(tf.Qwen3Config, tf.Qwen3ForCausalLM, L, head_dim=8),
    "phi3": lambda L: _llama_like(tf.Phi3Config, tf.Phi3ForCausalLM, L),
    "gemma": lambda L: _llama_like(tf.GemmaConfig, tf.GemmaForCausalLM, L, head_dim=8),
    "gemma2": lambda L: _llama_like(tf.Gemma2Config, tf.Gemma2ForCausalLM, L, head_dim=8, sliding_window=6,
                                    attn_implementation="eager"),
    "gemma3_text": lambda L: _llama_like(tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, L, head_dim=8,
                                         sliding_window=6, attn_implementation="eager"),
    "gpt2": lambda L: tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=L, n_head=4,
                                                        n_positions=512, bos_token_id=1, eos_token_id=2)),
    "gpt_neox": lambda L: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=L, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2)),
}

# Output projections of every block: shrinking them makes early exits agree with the full model often,
# so that tests exercise multi-token acceptance, not just rejection.
_OUT_PROJ = ("o_proj", "down_proj", "c_proj", "dense", "dense_4h_to_h")


def make_model(family: str, layers: int = 4, seed: int = 0, agreeable: bool = True, dtype=torch.float64):
    torch.manual_seed(seed)
    with torch.device("cpu"):  # the same weights on every test device: tests tuned to a seed stay meaningful
        model = FAMILIES[family](layers)
    if agreeable:
        with torch.no_grad():
            for name, module in model.named_modules():
                if name.rsplit(".", 1)[-1] in _OUT_PROJ and hasattr(module, "weight"):
                    module.weight.mul_(0.3)
    # float64 makes argmax ties between a 1-token and a k-token pass practically impossible
    return model.to(TEST_DEVICE, dtype).eval()


def padded_batch(seed: int = 0, lengths=(9, 5, 7), vocab: int = VOCAB):
    """Left-padded (3, T) batch with pad id 0 and its attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long, device="cpu")
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, vocab, (n,), generator=g, device="cpu")
        mask[row, width - n :] = 1
    return ids.to(TEST_DEVICE), mask.to(TEST_DEVICE)


def prompt(seed: int = 0, length: int = 8, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g, device="cpu").to(TEST_DEVICE)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (real weights) in float32, the dtype of the exactness tests, and its tokenizer;
    skipped when the package is not installed."""
    import torch

    from selfspec.models import load_default_model

    try:
        return load_default_model(dtype=torch.float32)
    except (ModuleNotFoundError, ImportError) as err:
        pytest.skip(str(err))


def greedy_with_scores(model, ids, max_new_tokens: int = 12):
    """(sequences, stacked scores) of a greedy generate: the tests that compare two runs' tokens and scores."""
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    return out.sequences, torch.stack(out.scores)
