"""The engine object that `wrap` puts on a model: what a Drafter object saves, stats after a fallback call, and
what `decode` does with the caller's settings and the exit layer."""
from __future__ import annotations

import importlib
import json
import warnings

import pytest
import torch

import selfspec
import selfspec.hf
from conftest import make_model, prompt
from selfspec.decoding import DecodeSettings
from selfspec.drafters.base import Draft, Drafter
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.ngram import NgramDrafter
from selfspec.drafters.oracle import OracleDrafter
from selfspec.heads import ExitHead

wrap_module = importlib.import_module("selfspec.wrap")  # `selfspec.wrap` is the function
LAYERS = 4
GEN = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)


class Mine(Drafter):
    """A drafter of the user's own, unknown to the config and the registry."""

    name = "mine"

    def propose(self, state, k):
        return Draft.empty(state.batch, state.device)


def _saved(tmp_path) -> dict:
    return json.loads((tmp_path / "selfspec_config.json").read_text())


# --- what a Drafter object saves --------------------------------------------------------------------------------

def test_drafter_object_saves_its_own_name(tmp_path):
    model = make_model("llama", LAYERS)
    ref = model.generate(prompt(), **GEN)
    selfspec.wrap(model, drafter=NgramDrafter(3, 1), exit_layer=2)
    assert model.selfspec.config.drafter == "ngram"
    assert torch.equal(model.generate(prompt(), **GEN), ref)
    model.selfspec.save_pretrained(tmp_path)
    assert _saved(tmp_path)["drafter"] == "ngram"
    selfspec.unwrap(model)
    selfspec.wrap(model, str(tmp_path))
    assert model.selfspec.config.drafter == "ngram" and model.selfspec.drafter_override is None


def test_early_exit_drafter_object_sets_the_exit_layer():
    """A head exiting at layer 2 on a 4-layer model: the config's split is the head's layer (the default 8 would
    not even fit), and a conflicting exit_layer is refused at wrap time."""
    model = make_model("llama", LAYERS)
    ref = model.generate(prompt(), **GEN)
    selfspec.wrap(model, drafter=EarlyExitDrafter(ExitHead(2)))
    assert (model.selfspec.config.drafter, model.selfspec.config.exit_layer) == ("early_exit", 2)
    assert torch.equal(model.generate(prompt(), **GEN), ref)
    selfspec.unwrap(model)
    with pytest.raises(ValueError, match="exits at layer 2.*exit_layer=3"):
        selfspec.wrap(model, drafter=EarlyExitDrafter(ExitHead(2)), exit_layer=3)


@pytest.mark.parametrize("drafter,why", [
    (lambda: OracleDrafter.from_rows([[5, 6, 7]]), "oracle"),
    (lambda: Mine(), "mine"),
])
def test_saving_a_drafter_the_config_cannot_rebuild_is_refused(tmp_path, drafter, why):
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, drafter=drafter(), exit_layer=2)
    assert model.selfspec.config.drafter == why
    with pytest.raises(ValueError, match=f"cannot save.*{why}.*cannot be rebuilt from a config"):
        model.selfspec.save_pretrained(tmp_path)
    assert not (tmp_path / "selfspec_config.json").exists()


def _calibrated(dtype: str, device: str, **fields) -> dict:
    """A config whose settings a calibration timed in `dtype` on `device`, as the calibrator records them."""
    timed = {"dtype": dtype, "device": device, "environment": {"cpu": "AMD EPYC", "cores": 2}}
    return {"exit_layer": 2, **fields, "metadata": {"calibration": timed}}


def test_settings_timed_in_another_dtype_or_on_another_device_warn_on_wrap():
    """The shipped config, timed in bf16 on an AVX512-BF16 CPU, decodes slower than plain generate in float32 on an
    AVX2 one (0.92x): wrapping a model that runs in another dtype or on another kind of device than the calibration
    says so and names the calibrator; the same dtype and device, a config that drafts nothing, or one no calibration
    wrote stay quiet."""
    model = make_model("llama", LAYERS)  # float64
    device = next(model.parameters()).device.type
    for other in (_calibrated("torch.bfloat16", device), _calibrated("torch.float64", "meta")):
        selfspec.hf._warned.clear()
        with pytest.warns(UserWarning, match=r"settings were timed in .* \(AMD EPYC, 2 cores\), and this model runs "
                                             rf"in float64 on {device}, .*`selfspec calibrate --model"):
            selfspec.wrap(model, other)
        selfspec.unwrap(model)
    for quiet in (_calibrated("torch.float64", device), _calibrated("torch.bfloat16", device, drafter="none"),
                  {"exit_layer": 2}):
        selfspec.hf._warned.clear()  # a warning given once is not given again: quiet must mean not warned at all
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            selfspec.wrap(model, quiet)
        selfspec.unwrap(model)


def test_saving_a_drafter_object_with_settings_the_config_lacks_is_refused(tmp_path):
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, drafter=NgramDrafter(5, 2), exit_layer=2)
    with pytest.raises(ValueError, match=r"ngram_max: 5 in the drafter object, 3 from the config.*"
                                         r"drafter='ngram', ngram_max=5"):
        model.selfspec.save_pretrained(tmp_path)
    selfspec.unwrap(model)
    selfspec.wrap(model, drafter=NgramDrafter(5, 2), exit_layer=2, ngram_max=5, ngram_min=2)
    model.selfspec.save_pretrained(tmp_path)  # the config now rebuilds exactly this drafter
    assert (_saved(tmp_path)["drafter"], _saved(tmp_path)["ngram_max"]) == ("ngram", 5)


def test_saving_with_a_draft_model_warns_that_the_model_is_not_saved(tmp_path):
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, drafter=make_model("llama", 1, seed=3), exit_layer=2)
    with pytest.warns(UserWarning, match="draft model itself is not saved.*drafter=draft_model"):
        model.selfspec.save_pretrained(tmp_path)
    assert _saved(tmp_path)["drafter"] == "model"


# --- stats after a fallback call --------------------------------------------------------------------------------

def test_last_stats_is_not_stale_after_a_fallback_call():
    selfspec.hf._warned.clear()
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, exit_layer=2)
    model.generate(prompt(), **GEN)
    engine = model.selfspec
    assert engine.last_stats is not None and engine.last_stats.new_tokens == 12 and engine.last_fallback is None
    with pytest.warns(UserWarning, match="beam search"):
        model.generate(prompt(), num_beams=2, **GEN)
    assert engine.last_stats is None  # the plain generate ran: no speculative stats to show
    assert "beam search" in engine.last_fallback
    model.generate(prompt(), **GEN)
    assert engine.last_stats is not None and engine.last_fallback is None


# --- decode: the caller's settings and the exit layer -----------------------------------------------------------

def test_decode_leaves_the_callers_settings_alone():
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=3)
    settings = DecodeSettings(max_length=20, pad_token_id=0, max_draft_tokens=6, exit_layer=1)
    before = dict(vars(settings))  # shallow: the same processors object, equal field values
    ids = prompt()
    first, _ = model.selfspec.decode(ids, None, settings)
    assert vars(settings) == before
    second, _ = model.selfspec.decode(ids, None, settings)  # the same settings object again
    assert torch.equal(first, second)


def test_exit_layer_out_of_range_at_decode_is_an_error_not_a_clamp():
    """A config changed after wrap (as calibration or a user may do) with an exit layer the model does not have:
    the early-exit drafter must not silently run at another layer."""
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, exit_layer=2)
    model.selfspec.config.exit_layer = 7
    with pytest.raises(ValueError, match=r"exit_layer=7 is out of range.*early_exit.*1 <= exit_layer <= 3"):
        model.generate(prompt(), **GEN)
    model.selfspec.config.exit_layer = 0
    with pytest.raises(ValueError, match=r"exit_layer=0 is out of range"):
        model.generate(prompt(), **GEN)


@pytest.mark.parametrize("drafter", ["ngram", "none"])
def test_drafters_without_early_layers_verify_every_layer_in_one_pass(monkeypatch, drafter):
    """Such drafters bring no layer-E states, so the split is not theirs to choose: the engine passes
    exit_layer = L (every layer in one pass) whatever the config says, and the output is the plain model's."""
    model = make_model("llama", LAYERS)
    ref = model.generate(prompt(), **GEN)
    seen = []
    real = wrap_module.speculative_decode
    monkeypatch.setattr(wrap_module, "speculative_decode",
                        lambda ctx, d, ids, mask, settings: seen.append(settings.exit_layer) or real(
                            ctx, d, ids, mask, settings))
    for exit_layer in (2, 50):
        selfspec.wrap(model, drafter=drafter, exit_layer=exit_layer)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert torch.equal(model.generate(prompt(), **GEN), ref)
        finally:
            selfspec.unwrap(model)
    assert seen == [LAYERS, LAYERS]


# --- what wrap drafts with when it is given nothing -------------------------------------------------------------
def test_wrap_without_heads_drafts_with_ngrams_and_says_so_once(monkeypatch):
    monkeypatch.setattr(selfspec.hf, "_warned", set())
    model = make_model("llama", LAYERS)
    ids = prompt(seed=3, length=12)
    plain = model.generate(ids, **GEN)
    with pytest.warns(UserWarning, match=r"no trained exit heads .* n-gram lookups .*docs/training.md"):
        selfspec.wrap(model)
    assert (model.selfspec.config.drafter, model.selfspec.config.max_draft_tokens) == ("ngram", 8)
    assert torch.equal(model.generate(ids, **GEN), plain)
    selfspec.unwrap(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: the second wrap is quiet
        selfspec.wrap(model, max_draft_tokens=3)
    assert (model.selfspec.config.drafter, model.selfspec.config.max_draft_tokens) == ("ngram", 3)
    selfspec.unwrap(model)


def test_an_exit_layer_or_a_drafter_keeps_what_was_asked():
    model = make_model("llama", LAYERS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selfspec.wrap(model, exit_layer=2)
        assert model.selfspec.config.drafter == "early_exit"
        selfspec.unwrap(model)
        selfspec.wrap(model, drafter="hybrid", exit_layer=2)
        assert model.selfspec.config.drafter == "hybrid"
        selfspec.unwrap(model)


def test_assigning_settings_is_the_validated_call():
    """`model.selfspec.config = ...` (what tools and users do) is checked as `wrap` checks: a bad value is refused in
    one line naming the field, and the engine keeps the settings it had."""
    model = make_model("llama", 4, dtype=torch.float32)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
    try:
        with pytest.raises(ValueError, match="max_draft_tokens must be an integer >= 1"):
            model.selfspec.config = model.selfspec.config.replace(max_draft_tokens=0)
        with pytest.raises(ValueError, match="exit_layer"):
            model.selfspec.config = model.selfspec.config.replace(exit_layer=9)
        assert model.selfspec.config.max_draft_tokens == 4 and model.selfspec.config.exit_layer == 2
    finally:
        selfspec.unwrap(model)
