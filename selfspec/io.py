"""Save and load what selfspec adds to a model: the config (JSON) and exit-head weights (safetensors), tagged with
the base model's identity so that heads never load silently onto a model they were not trained for."""
from __future__ import annotations

import dataclasses
import json
import os

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import CONFIG_FIX, CONFIG_NAME, SelfSpecConfig, read_config_json
from .heads import ExitHead, build_head
from .tp_weights import dense_rows

HEADS_FILE = "heads.safetensors"
_FINGERPRINT_ROWS = 64


def placement(model) -> dict:
    """Where a model runs and in what dtype, read off its first parameter: what a calibration records beside its
    timings (tools.measure.model_identity) and what `wrap` holds a calibrated config's timings against."""
    param = next(model.parameters())
    return {"device": param.device.type, "dtype": str(param.dtype)}


@torch.no_grad()
def model_identity(adapter) -> dict:
    """model_type, sizes and a dtype-robust fingerprint of the LM head: statistics of 64 fixed rows."""
    weight = adapter.lm_head.weight
    rows = torch.linspace(0, weight.shape[0] - 1, _FINGERPRINT_ROWS).long().to(weight.device)
    sample = dense_rows(weight, rows).float()  # a collective on a tensor-parallel model
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
    """Write selfspec_config.json (config, base-model identity, head specs) and heads.safetensors.

    Refused (ValueError, nothing written) when the saved config would not rebuild the drafter in use; a warning
    when it rebuilds it only with a draft model the caller passes again (`check_drafter_saveable`)."""
    check_drafter_saveable(engine)
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


# Attributes of the built-in drafters that a config field sets under another name.
_CONFIG_FIELD_OF = {"threshold": "draft_confidence_threshold", "min_match": "hybrid_min_match",
                    "name": "hybrid_policy"}


def check_drafter_saveable(engine) -> None:
    """Raise ValueError unless `engine.config` rebuilds the drafter in use (`engine.drafter_override` if set, else
    the config's own); warn when the rebuild needs a draft model, which is not saved."""
    import warnings

    from .drafters import DRAFTERS

    override = engine.drafter_override
    name = engine.config.drafter if override is None else getattr(override, "name", None)
    what = f"drafter {name!r}" if override is None else f"{type(override).__name__} object (name {name!r})"
    refuse = f"selfspec cannot save this config: the drafter in use, {what},"
    if name not in DRAFTERS or not DRAFTERS[name].from_config:
        why = ("proposes a reference continuation that only its caller has" if name == "oracle"
               else "is not a drafter the config knows")
        raise ValueError(f"{refuse} cannot be rebuilt from a config (it {why}). Save with a drafter the config can "
                         f"build (model.selfspec.drafter_override = None; model.selfspec.config.drafter = "
                         f"'early_exit', 'ngram', 'hybrid' or 'none').")
    if name != engine.config.drafter:
        raise ValueError(f"{refuse} is not the config's drafter {engine.config.drafter!r}, so the saved config would "
                         f"rebuild another drafter. Set model.selfspec.config.drafter = {name!r} or drop the "
                         f"drafter_override.")
    if name == "model":
        warnings.warn("selfspec: the config says drafter='model' but the draft model itself is not saved; pass it "
                      "again when loading: selfspec.wrap(model, directory, drafter=draft_model).", stacklevel=3)
        return
    if override is None:
        return
    engine.drafter_override = None
    try:
        rebuilt = DRAFTERS[name].build(engine)
    finally:
        engine.drafter_override = override
    differences = _drafter_differences(override, rebuilt)
    if differences:
        fields = {_CONFIG_FIELD_OF.get(d.split(":")[0].rsplit(".", 1)[-1], d.split(":")[0].rsplit(".", 1)[-1]): v
                  for d, v in differences}
        known = {k: v for k, v in fields.items() if k in SelfSpecConfig.__dataclass_fields__}
        hint = "".join(f", {k}={v!r}" for k, v in known.items())
        raise ValueError(f"{refuse} has settings the config would not rebuild ({'; '.join(d for d, _ in differences)})."
                         f" Wrap with them as config fields instead: selfspec.wrap(model, drafter={name!r}{hint})"
                         f"{'' if len(known) == len(fields) else ', and heads added with model.selfspec.add_head'}.")


def _drafter_differences(used, rebuilt, path: str = "") -> list[tuple[str, object]]:
    """(description, value in use) for each setting in which a Drafter object differs from the config's rebuild:
    scalar attributes, heads (the same module, or the same parameter-free spec) and nested drafters."""
    from .drafters.base import Drafter

    out = []
    for key, value in vars(used).items():
        other, where = getattr(rebuilt, key, None), f"{path}{key}"
        if isinstance(value, Drafter):
            if type(other) is not type(value):
                out.append((f"{where}: a {type(value).__name__}, the config builds {type(other).__name__}", value))
            else:
                out.extend(_drafter_differences(value, other, where + "."))
        elif isinstance(value, torch.nn.Module):
            if not _same_module(value, other):
                out.append((f"{where}: a {type(value).__name__} the engine does not hold (its heads are what is "
                            f"saved)", value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a policy: field by field
            for f in dataclasses.fields(value):
                mine, theirs = getattr(value, f.name), getattr(other, f.name, None)
                if mine != theirs:
                    out.append((f"{where}.{f.name}: {mine!r} in the drafter object, {theirs!r} from the config", mine))
        elif isinstance(value, (bool, int, float, str)) and value != other:
            out.append((f"{where}: {value!r} in the drafter object, {other!r} from the config", value))
    return out


def _same_module(a, b) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or not hasattr(a, "spec") or a.spec() != b.spec():
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


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
    tensors = _read_heads_file(path) if os.path.isfile(path) else {}
    heads = []
    for spec in specs:
        try:
            head = build_head(spec, adapter)
        except (KeyError, TypeError, ValueError) as err:  # a head spec without a field it needs, or with a bad one
            what = f"no {err.args[0]!r} field" if isinstance(err, KeyError) else " ".join(str(err).split())
            raise ValueError(f"{os.path.join(directory, CONFIG_NAME)}: the exit-layer-{spec.get('exit_layer')} head "
                             f"spec is not one selfspec can build ({what}). {CONFIG_FIX}") from err
        prefix = f"layer{spec['exit_layer']}."
        state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
        _load_state(head, state, spec, path)
        floats = [v.dtype for v in state.values() if v.is_floating_point()]
        # the engine computes in the LM head's dtype; saving again writes the weights as they came (bf16 stays small)
        head.stored_dtype = floats[0] if floats else None
        heads.append(head)
    return heads


HEADS_FIX = (f"Fix: copy {HEADS_FILE} again from the directory that wrote it beside this {CONFIG_NAME}, or train "
             "the heads again (selfspec prepare).")


def _read_heads_file(path: str) -> dict:
    """The tensors of a heads file; one that safetensors cannot read (cut short, or not safetensors) is refused
    naming it, as safetensors' own error is no ValueError and names no file."""
    try:
        return load_file(path)
    except SafetensorError as err:
        raise ValueError(f"{path} is not a readable safetensors file ({' '.join(str(err).split())}); it is cut short "
                         f"or damaged. {HEADS_FIX}") from err


def _load_state(head: ExitHead, state: dict, spec: dict, path: str) -> None:
    """Give a head its tensors from the heads file at `path`, in their saved dtype (fp32 or bf16). Tensors missing,
    unexpected or of another shape mean the file belongs to something else: refused naming it."""
    try:
        head.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as err:
        prefix = f"layer{spec['exit_layer']}."
        missing = sorted(set(head.state_dict()) - set(state))
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        found = f"no tensor {prefix}{missing[0]}{more}" if missing else " ".join(str(err).split("\n", 1)[-1].split())
        raise ValueError(f"{path} does not hold the weights of the exit-layer-{spec['exit_layer']} "
                         f"{spec.get('kind', 'norm')} head that {CONFIG_NAME} lists ({found}). {HEADS_FIX}") from err


def _base_path(model) -> str | None:
    """Where the base model came from; a model known by short name (converted into the cache) is recorded by it."""
    from .models import known_model_names, model_cache_dir

    path = getattr(model, "name_or_path", None) or None
    for name in known_model_names() if path else ():
        if os.path.realpath(path) == os.path.realpath(model_cache_dir(name)):
            return name
    return path


def _version() -> str:
    from . import __version__

    return __version__


def describe(directory: str) -> str:
    return json.dumps(read_config_json(directory), indent=2)
