"""The read-only view a drafter gets of the decode loop's state (drafters/base.py has the rest of the contract).

The loop owns the sequence, the positions and the shared KV cache; a drafter reads them here and asks for the
few things it may have done on its behalf: logits processed with its drafts as prefix, and its inputs run
through layers [0, E) into the shared cache (the states it hands back spare the verifier those layers).
"""
from __future__ import annotations

import torch



class DraftView:
    """What a drafter sees of one decode call, read-only: the loop's tokens, lengths and positions, the states the
    drafter asked for, and the few operations a drafter may run on the loop's behalf.

    Tokens: `seq` (B, S) each row's left-padded prompt and output, `seq_len` (B,) its valid length (`lengths`, the
    same on the host), `pending` (B,) the last emitted token, not yet in the cache, at position `pos` (B,);
    `finished` (B,) rows that are done (`done` on the host); `mask` the prompt's attention mask or None.
    Operations: `process` runs the logits processors on draft logits with the drafts before them as prefix;
    `text_with` is each row's text followed by drafts; `run_early` runs inputs through layers [0, E) into the
    shared cache (the verifier then skips those layers for them: Draft.hidden); `run_own` runs a head's own
    decoder layer against the loop's slot table.

    Nothing else is written through it: assigning an attribute raises, and the loop refuses a drafter that
    changed one of its tensors in place (decoding.guarded)."""

    __slots__ = ("_state",)

    def __init__(self, state):
        object.__setattr__(self, "_state", state)

    def __setattr__(self, name, value):
        raise AttributeError(f"DraftView is read-only (tried to set {name!r}): a drafter returns its proposal as a "
                             f"Draft and keeps its own state on itself; the loop writes the sequence and the cache.")

    # the loop's state, read through (the loop checks after every drafter call that its tensors are unchanged)
    batch = property(lambda self: self._state.batch)
    device = property(lambda self: self._state.device)
    vocab_size = property(lambda self: self._state.vocab_size)
    prompt_len = property(lambda self: self._state.prompt_len)
    do_sample = property(lambda self: self._state.do_sample)
    settings = property(lambda self: self._state.settings)
    adapter = property(lambda self: self._state.runner.adapter)
    seq = property(lambda self: self._state.seq)
    seq_len = property(lambda self: self._state.seq_len)
    lengths = property(lambda self: tuple(self._state.lengths))
    done = property(lambda self: tuple(self._state.done))
    pending = property(lambda self: self._state.pending)
    pos = property(lambda self: self._state.pos)
    finished = property(lambda self: self._state.finished)
    mask = property(lambda self: self._state.mask)
    step = property(lambda self: self._state.step)
    copy_k = property(lambda self: self._state.copy_k)

    @property
    def verified_len(self) -> int:
        """Slots of the verified prefix in the shared cache (a host int)."""
        return self._state.runner.verified_len()

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._state.is_eos(tokens)

    def text_with(self, drafts: torch.Tensor) -> torch.Tensor:
        """(B, S) a copy of `seq` in which each row's text goes on with its (B, w) drafts."""
        state = self._state
        text = state.seq.clone()
        cols = state.seq_len[:, None] + torch.arange(drafts.shape[1], device=state.device)[None, :]
        return text.scatter_(1, cols, drafts)

    def process(self, logits: torch.Tensor, drafts=None) -> torch.Tensor:
        """(B, T, V) float32 draft logits -> processed, position j following each row's text, its (B, w) `drafts`
        (a tensor, or a list of w (B,) tensors; None: none) and j more tokens: what the verifier's processors will
        see there if the drafts are accepted."""
        state = self._state
        if isinstance(drafts, (list, tuple)):
            drafts = torch.stack(drafts, dim=1) if drafts else None
        if drafts is None or drafts.shape[1] == 0 or not state.settings.processors:
            return state.settings.processors(state.seq, state.seq_len, logits)
        return state.settings.processors(self.text_with(drafts), state.seq_len + drafts.shape[1], logits)

    def run_early(self, inputs: torch.Tensor, positions: torch.Tensor, exit_layer: int,
                  tree: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) verify inputs of this step at (B, T) positions through layers [0, exit_layer) into the shared
        cache, after the inputs run before them this step; returns their (B, T, H) layer-E states, which the draft
        hands over (Draft.hidden) so that verification skips those layers for them. `tree` (B, M, M): the ancestor
        matrix (trees.tree_ancestors) of the step's inputs so far, when they form a tree."""
        return self._state.runner.early(inputs, positions, exit_layer, tree=self._tree(tree))

    def own_cache(self):
        """A one-layer KV cache for the drafter's own module, sized like the shared cache (Runner.own_cache)."""
        return self._state.runner.own_cache()

    def run_own(self, fn, module, like: int, cache, positions: torch.Tensor, *states: torch.Tensor,
                tree: torch.Tensor | None = None) -> torch.Tensor:
        """A pass of the drafter's own module (a head's copy of decoder layer `like`, and what it computes around
        it): `fn(adapter, module, positions, mask, cache, *states)` on (B, T, H) states at (B, T) positions, its KV
        in the drafter's own `cache`, masked by the loop's slot table, compiled where the loop's passes are
        (Runner.run_own)."""
        return self._state.runner.run_own(fn, module, like, cache, positions, *states, tree=self._tree(tree))

    def _tree(self, ancestors):
        """The runner's tree mask for a step's inputs whose (B, M, M) ancestors are given: they start at the
        verified prefix's end."""
        return None if ancestors is None else (self.verified_len, ancestors)
