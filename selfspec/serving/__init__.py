"""selfspec's drafters inside vLLM (docs/serving.md).

    vllm_ngram.py   selfspec's prompt lookup as vLLM's `custom_class` proposer (token ids only)
    vllm_draft.py   the trained exit head as an EAGLE-style vLLM draft model, registered by a vLLM plugin
    export.py       `selfspec export-vllm`: a prepared directory -> what vLLM loads, and the lines to load it

Only the first two import vLLM, and only inside vLLM's own processes; `export.py` runs in selfspec's environment.
"""
