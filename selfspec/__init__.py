"""selfspec: self-speculative decoding for Hugging Face causal LMs.

    model = selfspec.wrap(model, exit_layer=8, max_draft_tokens=6)   # in place
    out = model.generate(input_ids, max_new_tokens=128)               # same tokens, fewer full passes
    model.selfspec.last_stats
"""
from .config import SelfSpecConfig
from .decoding import GenerationStats
from .wrap import SelfSpecEngine, unwrap, wrap

__version__ = "0.1.0"
__all__ = ["SelfSpecConfig", "GenerationStats", "SelfSpecEngine", "wrap", "unwrap", "__version__"]
