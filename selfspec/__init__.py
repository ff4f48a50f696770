"""selfspec: self-speculative decoding for Hugging Face causal LMs.

    model = selfspec.wrap(model, exit_layer=8, max_draft_tokens=6)   # in place
    out = model.generate(input_ids, max_new_tokens=128)               # same tokens, fewer full passes
    model.selfspec.last_stats
"""
from .config import SelfSpecConfig
from .decoding import GenerationStats
from .wrap import SelfSpecEngine, unwrap, wrap


def from_pretrained(name_or_dir: str = "smollm2-135m", **kwargs):
    """(wrapped model, tokenizer) for an embedded model name, a saved selfspec directory or an HF model path."""
    from .pretrained import from_pretrained as _load

    return _load(name_or_dir, **kwargs)


__version__ = "0.1.0"
__all__ = ["SelfSpecConfig", "GenerationStats", "SelfSpecEngine", "wrap", "unwrap", "from_pretrained", "__version__"]
