"""`generate()` for a wrapped model: Hugging Face prepares inputs, config, processors and stopping criteria as
usual and hands its decoding loop over to ours through `custom_generate`. What cannot run speculatively goes to
the plain `generate` with a one-time warning saying why."""
from __future__ import annotations

import warnings

import torch
from transformers import GenerationMixin, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StopStringCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .decoding import DecodeSettings
from .processing import PrefixProcessor, impure_processor_reason

_warned: set[str] = set()


def warn_once(message: str, stacklevel: int = 4) -> None:
    """Warn with `message` the first time it comes up in this process (a per-call warning would flood loops)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=stacklevel)


def _warn_once(reason: str) -> None:
    warn_once(f"selfspec: {reason}; falling back to the model's plain generate().")


def fallback_reason(gen, kwargs: dict, batch_size: int | None = None, streamer=None) -> str | None:
    """Why a call with resolved GenerationConfig `gen` and these kwargs cannot be speculative, or None."""
    checks = [
        # HF's loop puts one token per row and step; rows of a speculative batch advance by different counts, so
        # no put sequence matches it. The plain generate keeps HF's own rule (its streamers raise for batch > 1).
        (streamer is not None and (batch_size or 1) > 1,
         "a streamer with batch size > 1 (Hugging Face's streamers take one row)"),
        (gen.num_beams and gen.num_beams > 1, "beam search (num_beams > 1) is not speculative"),
        (getattr(gen, "penalty_alpha", None), "contrastive search (penalty_alpha) is not speculative"),
        (getattr(gen, "dola_layers", None), "DoLa decoding is not supported"),
        (getattr(gen, "guidance_scale", None) not in (None, 1, 1.0), "classifier-free guidance is not supported"),
        (gen.output_attentions or gen.output_hidden_states,
         "output_attentions / output_hidden_states need per-step model outputs"),
        (gen.output_logits, "output_logits (raw logits per step) is not supported; use output_scores"),
        (gen.use_cache is False, "use_cache=False was requested"),
        (getattr(gen, "prompt_lookup_num_tokens", None) or getattr(gen, "assistant_early_exit", None)
         or kwargs.get("assistant_model") is not None, "Hugging Face's own assisted generation was requested"),
        (kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None,
         "a pre-filled cache was passed"),
        (kwargs.get("inputs_embeds") is not None, "inputs_embeds instead of input_ids"),
        (kwargs.get("prefix_allowed_tokens_fn") is not None, "prefix_allowed_tokens_fn is not supported"),
        (getattr(gen, "cache_implementation", None) not in (None, "dynamic"),
         f"cache_implementation={getattr(gen, 'cache_implementation', None)!r} is not supported"),
    ]
    return next((reason for failed, reason in checks if failed), None)


def wrapped_generate(model, inputs=None, generation_config=None, logits_processor=None, stopping_criteria=None,
                     streamer=None, **kwargs):
    """Replaces `model.generate` on a wrapped instance (the class's generate is untouched)."""
    gen, _ = model._prepare_generation_config(generation_config, **dict(kwargs))
    reason = fallback_reason(gen, kwargs, _batch_size(inputs, kwargs), streamer) or \
        impure_processor_reason(logits_processor)
    engine = model.selfspec
    engine.last_fallback = reason
    if reason is not None:
        _warn_once(reason)
        engine.last_stats = None  # this call has no speculative stats; an earlier call's must not pass for them
        return GenerationMixin.generate(model, inputs, generation_config, logits_processor, stopping_criteria,
                                        streamer=streamer, **kwargs)
    # HF drops `tokenizer`, `assistant_tokenizer` and `streamer` before calling a custom decoding loop, so stop
    # strings become our own criterion here, and the streamer and tokenizers travel under names HF passes through.
    tokenizer = kwargs.pop("tokenizer", None)
    assistant_tokenizer = kwargs.pop("assistant_tokenizer", None)
    stopping_criteria = StoppingCriteriaList(stopping_criteria or [])
    if gen.stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: call generate(..., stop_strings=..., tokenizer=tok).")
        stopping_criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=gen.stop_strings))
        kwargs["stop_strings"] = None  # ours now; HF would ask for the tokenizer it no longer has
    return GenerationMixin.generate(
        model, inputs, generation_config, logits_processor, stopping_criteria,
        custom_generate=_speculative_loop, selfspec_streamer=streamer,
        selfspec_tokenizers=(tokenizer, assistant_tokenizer), **kwargs,
    )


def _batch_size(inputs, kwargs: dict) -> int | None:
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    return ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _speculative_loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                      selfspec_streamer=None, selfspec_tokenizers=None, **model_kwargs):
    """The decoding method Hugging Face's generate calls after its input preparation."""
    engine = model.selfspec
    eos = generation_config._eos_token_tensor
    eos_ids = [] if eos is None else [int(t) for t in eos.flatten().tolist()]
    pad = generation_config._pad_token_tensor
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    criteria = [c for c in stopping_criteria if not isinstance(c, (MaxLengthCriteria, EosTokenCriteria))]
    settings = DecodeSettings(
        max_length=generation_config.max_length,
        do_sample=bool(generation_config.do_sample),
        eos_token_ids=eos_ids,
        pad_token_id=pad_id,
        processors=PrefixProcessor(logits_processor),
        criteria=criteria,
        streamer=selfspec_streamer,
        output_scores=bool(generation_config.output_scores and generation_config.return_dict_in_generate),
        timed=engine.timed,
    )
    sequences, state = engine.decode(input_ids, model_kwargs.get("attention_mask"), settings,
                                     tokenizers=selfspec_tokenizers)
    if not generation_config.return_dict_in_generate:
        return sequences
    scores = _stack_scores(state, sequences.shape[1] - input_ids.shape[1]) if settings.output_scores else None
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores)


def _stack_scores(state, steps: int):
    """Per-row lists of (V,) processed scores -> tuple over steps of (B, V); -inf where a row had finished."""
    out = []
    for t in range(steps):
        rows = [s[t] if t < len(s) else None for s in state.scores]
        like = next(r for r in rows if r is not None)
        out.append(torch.stack([r if r is not None else torch.full_like(like, float("-inf")) for r in rows]))
    return tuple(out)
