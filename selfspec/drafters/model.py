"""Classic speculative decoding: a separate, smaller causal LM with the same vocabulary drafts the tokens.

The draft model keeps a cache of its own (a `SpecCache` + `SlotTable` in a `Runner` of its own, run through
`Runner.early` with exit_layer = its number of layers), in step with the verified prefix:

* `begin` prefills it with the prompt (same left padding, same positions as the verifier).
* `propose` first feeds what the verifier has emitted since the draft model last saw the row (`fed` (B,) says how
  far into `view.seq` it has read): always the pending token, plus the last draft of the previous step when all
  drafts were accepted (the draft model proposes d_k without ever feeding it). Rows need different numbers of
  catch-up tokens, so they are fed as one right-aligned (B, U) block whose missing left entries are holes
  (slot position -1), the same trick the engine uses for left padding. Then it drafts k tokens autoregressively,
  feeding d_1 .. d_{k-1}.
* `accepted` keeps, per row, the catch-up block and the first min(n, fed drafts) draft slots; the rest become
  holes and the cache is cut back to the longest row, exactly like the verifier's own rollback.

q is the draft model's distribution after the same logits processors as the target (`view.process`) when
sampling, so that rejection sampling is exact; greedy decoding drafts the processed argmax with q = None.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..arch import adapter_for
from ..cache import SlotTable, SpecCache
from ..runner import Runner
from .base import Draft, Drafter, choose_draft


def _rows(model) -> dict:
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return {"LM head rows": None if head is None else head.weight.shape[0],
            "embedding rows": None if emb is None else emb.weight.shape[0]}


def _local_tokenizer(model):
    """The tokenizer saved with `model` (its name_or_path, local files only), or None."""
    path = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # no tokenizer there, or not loadable offline: the check does without it
        return None


def vocab_mismatch(target, draft, target_tokenizer=None, draft_tokenizer=None) -> str | None:
    """Why `draft` cannot draft for `target` (a vocabulary difference), or None. Both are HF causal LMs.

    With tokenizers (one given alone is taken as shared by both models): the target's and the draft's must map the
    same strings to the same ids, and each model needs a row for every id; rows past the tokenizer's ids do not
    matter, so same-tokenizer models whose embeddings are padded to different row counts (Qwen2.5-0.5B: 151,936,
    Qwen2.5-7B: 152,064) pass. Without tokenizers, the tokenizers saved with the models are used when both load
    offline; else the models' row counts and config.vocab_size must agree."""
    rows = {"target": _rows(target), "draft": _rows(draft)}
    for role, model in (("target", target), ("draft", draft)):
        rows[role]["config.vocab_size"] = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    differ = next(((what, a, rows["draft"][what]) for what, a in rows["target"].items()
                   if a is not None and rows["draft"][what] is not None and a != rows["draft"][what]), None)
    if target_tokenizer is None and draft_tokenizer is None:
        if differ is None:
            return None
        target_tokenizer, draft_tokenizer = _local_tokenizer(target), _local_tokenizer(draft)
        if target_tokenizer is None or draft_tokenizer is None:
            what, a, b = differ
            return (f"{what} differ: target {a}, draft {b}; if both use one tokenizer and only the embedding padding "
                    f"differs, pass it: selfspec.wrap(model, drafter=draft_model, tokenizer=tok) or "
                    f"generate(..., tokenizer=tok)")
    target_tokenizer = target_tokenizer if target_tokenizer is not None else draft_tokenizer
    draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else target_tokenizer
    vocab = target_tokenizer.get_vocab()
    if draft_tokenizer is not target_tokenizer:
        other = draft_tokenizer.get_vocab()
        if other != vocab:
            changed = sorted(set(vocab.items()) ^ set(other.items()), key=lambda kv: kv[1])
            token = changed[0][0]
            return (f"the tokenizers differ in {len({t for t, _ in changed})} of {len(vocab)} tokens, e.g. {token!r}: "
                    f"id {vocab.get(token)} for the target, {other.get(token)} for the draft")
    ids = max(vocab.values()) + 1
    for role in ("target", "draft"):
        for what in ("LM head rows", "embedding rows"):
            n = rows[role][what]
            if n is not None and n < ids:
                return f"the tokenizer has ids up to {ids - 1} but the {role} model has {n} {what}"
    return None


def check_draft_model(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raise ValueError unless `draft` is a causal LM that shares the target's vocabulary (`vocab_mismatch`)."""
    if draft is target:
        raise ValueError("The draft model is the target model itself; pass a separate, smaller model.")
    reason = vocab_mismatch(target, draft, target_tokenizer, draft_tokenizer)
    if reason is not None:
        raise ValueError(
            f"The draft model {type(draft).__name__} does not share the target's vocabulary ({reason}). "
            f"Speculative decoding compares token ids, so the draft model must use the same tokenizer: pick a "
            f"smaller model of the same family (e.g. SmolLM2-135M drafting for SmolLM2-1.7B)."
        )


@dataclass
class _Step:
    """What `propose` did to the draft cache, for `accepted` to roll back."""

    base: int  # draft-cache length before this step
    block: int  # width U of the catch-up block
    fed_drafts: int  # drafts d_1.. fed after the block
    seq_len: torch.Tensor  # (B,) view.seq_len when proposing (the pending token sits at seq_len - 1)


class DraftModelDrafter(Drafter):
    name = "model"

    def __init__(self, draft_model, target=None, tokenizer=None, draft_tokenizer=None, checked: bool = False):
        """target: the model to draft for, checked against (`check_draft_model`, with the tokenizers if given)
        unless `checked` says the caller has done so."""
        if target is not None and not checked:
            check_draft_model(target, draft_model, tokenizer, draft_tokenizer)
        self.model = draft_model
        self.adapter = adapter_for(draft_model)
        self.device = self.adapter.device_of_layer(0)
        # ids the draft model can embed; the target's vocabulary size (set in begin): the two may differ by padding
        self.embed_rows = draft_model.get_input_embeddings().weight.shape[0]
        self.vocab: int | None = None
        self.runner: Runner | None = None  # the draft model's passes over its own cache
        self.fed: torch.Tensor | None = None  # (B,) tokens of view.seq the draft cache holds, per row
        self.step: _Step | None = None

    # --- the draft model's own forward ----------------------------------------------------------------------
    def _embeddable(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) ids on the draft model's device. An id past its rows (the target chose one of its own padding
        rows) cannot be embedded; any valid id stands in for it: only the draft's guesses get worse, never the
        output."""
        return ids.masked_fill(ids >= self.embed_rows, 0).to(self.device)

    def _run(self, ids, positions, slot_positions=None) -> torch.Tensor:
        """All layers of the draft model on (B, T) tokens -> (B, T, V) float32 logits on the target's device."""
        dev = self.device
        hidden = self.runner.early(self._embeddable(ids), positions.to(dev), self.adapter.num_layers,
                                   None if slot_positions is None else slot_positions.to(dev))
        logits = self.adapter.logits(self.adapter.final_norm(hidden[:, -1:])).float().to(ids.device)
        return _fit_vocab(logits, self.vocab)

    def begin(self, view, prompt) -> None:
        self.vocab = view.vocab_size
        mask = None if view.mask is None else view.mask.to(self.device)
        prompt = self._embeddable(view.seq[:, : view.prompt_len])
        self.runner = Runner(self.adapter, SpecCache(self.adapter.num_layers), SlotTable.for_prompt(prompt, mask))
        # the prompt enters the draft cache as it enters the verifier's: same positions, padding as holes
        self.runner.prompt(prompt, mask, self.adapter.num_layers)
        self.fed = torch.full_like(view.seq_len, view.prompt_len)
        self.step = None

    def _catch_up(self, view) -> tuple[torch.Tensor, int]:
        """Feed each row's unseen verified tokens (ending with the pending one) as one right-aligned block.
        Returns the (B, V) logits after the block and its width U."""
        unseen = (view.seq_len - self.fed).masked_fill(view.finished, 1).clamp(min=1)
        width = int(unseen.max())
        j = torch.arange(width, device=view.device)[None, :]
        index = view.seq_len[:, None] - width + j  # (B, U) right-aligned: the last column is the pending token
        positions = view.pos[:, None] - (width - 1) + j
        hole = (index < (view.seq_len - unseen)[:, None]) | view.finished[:, None]
        ids = view.seq.gather(1, index.clamp(min=0))
        slot_positions = positions.masked_fill(hole, -1)
        return self._run(ids, positions.clamp(min=0), slot_positions)[:, -1], width

    def propose(self, view, k: int) -> Draft:
        if k == 0:
            self.step = None
            return Draft.empty(view.batch, view.device)
        base = self.runner.cache.layer_length(0)
        logits, width = self._catch_up(view)
        active = ~view.finished
        draft_len = torch.zeros_like(view.seq_len)
        tokens, qs = [], []
        fed_drafts = 0
        for j in range(k):
            token, probs, _ = choose_draft(view, logits, tokens)
            draft_len += active.long()
            active = active & ~view.is_eos(token)  # nothing is drafted after an EOS
            tokens.append(token)
            if probs is not None:
                qs.append(probs)
            if j + 1 == k or not bool(active.any()):
                break
            logits = self._run(token[:, None], view.pos[:, None] + j + 1)[:, -1]
            fed_drafts += 1
        self.step = _Step(base, width, fed_drafts, view.seq_len.clone())
        return Draft(tokens=torch.stack(tokens, dim=1), draft_len=draft_len,
                     q=torch.stack(qs, dim=1) if qs else None)

    def accepted(self, view, draft: Draft, n: torch.Tensor, verified) -> None:
        step = self.step
        if step is None:
            return
        keep = torch.minimum(n, torch.full_like(n, step.fed_drafts)).to(self.device)
        start = step.base + step.block
        self.runner.slots.keep_prefix(start, keep, start + step.fed_drafts)
        self.runner.cache.rollback(start + int(keep.max()))
        self.fed = step.seq_len + keep.to(view.device)
        self.step = None


def _fit_vocab(logits: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """(..., V_draft) logits -> (..., vocab), the target's width: the draft's extra (padding) rows are dropped, rows
    it lacks get -inf (it never proposes them). Exact either way: q is the distribution the drafts come from."""
    width = logits.shape[-1]
    if vocab is None or width == vocab:
        return logits
    if width > vocab:
        return logits[..., :vocab]
    return torch.nn.functional.pad(logits, (0, vocab - width), value=float("-inf"))


# draft model -> (target, tokenizer, draft tokenizer) of the last check it passed: the check reads both vocabularies
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def from_engine(engine) -> DraftModelDrafter:
    """The registry's factory for drafter="model": the draft model the engine holds, checked against the target
    (once per draft model, target and tokenizers: _CHECKED remembers the pairs that passed)."""
    if engine.draft_model is None:
        raise ValueError('drafter="model" needs a draft model: selfspec.wrap(model, drafter=draft_model), or set '
                         'model.selfspec.draft_model = draft_model.')
    tokenizers = engine.draft_tokenizers() if hasattr(engine, "draft_tokenizers") else (None, None)
    key = (engine.model, *tokenizers)
    checked = _CHECKED.get(engine.draft_model)
    if checked is None or not all(a is b for a, b in zip(checked, key)):
        check_draft_model(engine.model, engine.draft_model, *tokenizers)
        _CHECKED[engine.draft_model] = key
    return DraftModelDrafter(engine.draft_model, engine.model, *tokenizers, checked=True)
