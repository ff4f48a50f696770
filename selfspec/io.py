"""Save and load what selfspec adds to a model: the config (JSON) and exit-head weights (safetensors), tagged with
the base model's identity so that heads never load silently onto a model they were not trained for."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from .config import SelfSpecConfig, read_config_json
from .heads import ExitHead, build_head

HEADS_FILE = "heads.safetensors"
_FINGERPRINT_ROWS = 64


@torch.no_grad()
def model_identity(adapter) -> dict:
    """model_type, sizes and a dtype-robust fingerprint of the LM head: statistics of 64 fixed rows."""
    weight = adapter.lm_head.weight
    rows = torch.linspace(0, weight.shape[0] - 1, _FINGERPRINT_ROWS).long().to(weight.device)
    sample = weight[rows].float()
    return {
        "model_type": adapter.config.model_type,
        "hidden_size": adapter.hidden_size,
        "vocab_size": adapter.vocab_size,
        "num_layers": adapter.num_layers,
        "lm_head_fingerprint": [round(v, 6) for v in sample.mean(dim=1).tolist()]
        + [round(float(sample.std()), 6)],
    }


def check_identity(saved: dict, adapter, source: str) -> None:
    """Raise ValueError naming every mismatch between saved and live identity."""
    live = model_identity(adapter)
    problems = [f"{key}: saved {saved[key]!r}, this model {live[key]!r}"
                for key in ("model_type", "hidden_size", "vocab_size", "num_layers") if saved.get(key) != live[key]]
    if not problems and "lm_head_fingerprint" in saved:
        a = torch.tensor(saved["lm_head_fingerprint"])
        b = torch.tensor(live["lm_head_fingerprint"])
        # bf16 / fp16 / 8-bit copies of the same weights stay within this band; other weights do not
        if not torch.allclose(a, b, rtol=0.05, atol=2e-3 * float(b.abs().max() + 1e-8)):
            problems.append("lm_head_fingerprint: the LM head weights differ (another checkpoint of the same shape)")
    if problems:
        raise ValueError(
            f"The selfspec heads in {source!r} were saved for another model ({'; '.join(problems)}). "
            "Train heads for this model (selfspec train-heads) or wrap without them."
        )


def save_engine(engine, directory: str) -> str:
    """Write selfspec_config.json (config, base-model identity, head specs) and heads.safetensors."""
    os.makedirs(directory, exist_ok=True)
    tensors, specs = {}, []
    for layer, head in sorted(engine.heads.items()):
        specs.append(head.spec())
        stored = getattr(head, "stored_dtype", None)
        for name, value in head.state_dict().items():
            if value is not None:
                value = value.detach().to("cpu")
                if stored is not None and value.is_floating_point():
                    value = value.to(stored)
                tensors[f"layer{layer}.{name}"] = value.clone()  # heads may share vocab_ids
    if tensors:
        save_file(tensors, os.path.join(directory, HEADS_FILE), metadata={"format": "selfspec-heads"})
    extra = {"base_model": model_identity(engine.adapter), "base_model_path": _base_path(engine.model),
             "heads": specs, "selfspec_version": _version()}
    return engine.config.save(directory, extra=extra)


def load_heads(directory: str, adapter) -> list[ExitHead]:
    """Heads saved in `directory`, built for and checked against `adapter`'s model."""
    data = read_config_json(directory)
    if "base_model" in data:
        check_identity(data["base_model"], adapter, directory)
    specs = data.get("heads", [])
    if not specs:
        return []
    path = os.path.join(directory, HEADS_FILE)
    weighted = [s for s in specs if s.get("kind", "norm") != "norm" or s.get("draft_vocab_size")]
    if weighted and not os.path.isfile(path):
        raise FileNotFoundError(f"{directory!r} lists {len(weighted)} heads with weights but has no {HEADS_FILE}.")
    tensors = load_file(path) if os.path.isfile(path) else {}
    heads = []
    for spec in specs:
        head = build_head(spec, adapter)
        prefix = f"layer{spec['exit_layer']}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        head.load_state_dict(state, strict=True, assign=True)  # keep the saved dtype (fp32 or bf16)
        floats = [v.dtype for v in state.values() if v.is_floating_point()]
        # the engine computes in the LM head's dtype; saving again writes the weights as they came (bf16 stays small)
        head.stored_dtype = floats[0] if floats else None
        heads.append(head)
    return heads


def _base_path(model) -> str | None:
    """Where the base model came from; the embedded default is recorded by its short name."""
    from .models import DEFAULT_MODEL, model_cache_dir

    path = getattr(model, "name_or_path", None) or None
    if path and os.path.realpath(path) == os.path.realpath(model_cache_dir(DEFAULT_MODEL)):
        return DEFAULT_MODEL
    return path


def _version() -> str:
    from . import __version__

    return __version__


def describe(directory: str) -> str:
    return json.dumps(read_config_json(directory), indent=2)
