"""What an exit head keeps during one generate call, beside the drafter that runs it (drafters/early_exit.py):
the final states a top-reading head reads (TopStates), the text a copy head looks its candidates up in
(CopyPaths), and a stateful head's own KV cache (HeadCache). Each follows the verified prefix through the
drafter's `begin` and `accepted` hooks and reads the loop only through its DraftView."""
from __future__ import annotations

import torch

from .cache import SpecCache
from .lookup import PAD, SuffixIndex
from .heads import ExitHead, fused_pass, layer_pass, previous_top


class TopStates:
    """What a top-reading head reads during one generate call: `last` (B, H), the final-normed state of the last
    verified position (the verifier's own: from prefill, then from each verification at the accepted count), and
    `step`, the head's own normed output for each verify input drafted from so far this step, in input order,
    which the inputs after it read in place of the final states they cannot have yet."""

    def __init__(self):
        self.last, self.step = None, []

    def start(self, last: torch.Tensor) -> None:
        """A new step after the verified position whose final-normed state is `last` (B, H)."""
        self.last, self.step = last, []

    def begin(self, prompt) -> None:
        self.start(prompt.top[:, -1])  # left padding: the last column is real

    def accepted(self, verified, n: torch.Tensor) -> None:
        top = verified.top  # (B, k + 1, H): the step's inputs (after a tree, its path)
        self.start(top.gather(1, n.to(top.device)[:, None, None].expand(-1, 1, top.shape[-1]))[:, 0])

    def normed(self, head, adapter, hidden: torch.Tensor, parents: torch.Tensor | None, run=None) -> torch.Tensor:
        """(B, T, H) layer-E states of the step's next T verify inputs -> the head's (B, T, H) normed outputs,
        kept for the inputs after them. Each input reads its parent's output (`parents` (B, T) verify-input
        indices, from a tree's earlier levels), or with parents=None the one of the input before it, in order;
        the step's first input (the pending token) reads the last verified state. `run(hidden, prev, cols)` makes
        the outputs of the inputs `cols` (a slice) from their states and what they read; by default the head's
        `normed` (a fused head passes its cached layer's)."""
        run = run or (lambda h, prev, cols: head.normed(h, adapter, prev))
        if parents is not None:
            done = torch.cat(self.step, dim=1)  # (B, inputs so far, H)
            out = run(hidden, done.gather(1, parents[..., None].expand(-1, -1, done.shape[-1])), slice(None))
            self.step.append(out)
            return out
        outs = []
        for t in range(hidden.shape[1]):  # each needs the one before: a head call per input
            prev = self.step[-1][:, -1:] if self.step else self.last[:, None]
            self.step.append(run(hidden[:, t : t + 1], prev, slice(t, t + 1)))
            outs.append(self.step[-1])
        return torch.cat(outs, dim=1)


class CopyPaths:
    """What a copy head reads during one generate call: for each verify input of the step, the text that ends with
    it (the row's verified text, whose last token is the pending one, then the drafts on the input's path: a
    chain's earlier drafts or a tree node's ancestors) looked up as prompt lookup does, in a host-side SuffixIndex
    of each row's verified text."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.texts: list[SuffixIndex] = []  # [row]: its verified text so far, prompt padding as PAD
        self.paths: list[list[tuple]] = []  # [row][verify input of this step]: the drafts after the pending token

    def begin(self, view) -> None:
        prompt = view.seq[:, : view.prompt_len]
        if view.mask is not None:
            prompt = prompt.masked_fill(view.mask == 0, PAD)
        self.texts = [SuffixIndex(self.n_max) for _ in range(view.batch)]
        for index, row in zip(self.texts, prompt.tolist()):
            index.extend(row)
        self.start()

    def start(self) -> None:
        """A new step: its first input is the pending token (index 0), the last token of the verified text."""
        self.paths = [[] for _ in self.texts]

    def candidates(self, view, inputs: torch.Tensor, parents: torch.Tensor | None):
        """(B, T) the step's next verify inputs (parents: their parents' input indices, None: each follows the one
        before) -> (token (B, T), match (B, T)): each input's copy candidate (-1: none) and its match length."""
        self._catch_up(view)
        inputs_at, parents_at = inputs.tolist(), None if parents is None else parents.tolist()
        token, match = [], []
        for b, (index, paths) in enumerate(zip(self.texts, self.paths)):
            for t, tok in enumerate(inputs_at[b]):
                parent = len(paths) - 1 if parents_at is None else parents_at[b][t]
                paths.append(paths[parent] + (tok,) if paths else ())  # the pending token ends the text itself
                tok, n = index.candidate(paths[-1])
                token.append(tok)
                match.append(n)
        shape = inputs.shape
        return (torch.tensor(token, device=inputs.device).view(shape),
                torch.tensor(match, device=inputs.device).view(shape))

    def _catch_up(self, view) -> None:
        """Index what each row verified since the last step (once a step: the step's paths are still empty)."""
        for b, index in enumerate(self.texts):
            if not self.paths[b] and len(index.tokens) < view.lengths[b]:
                index.extend(view.seq[b, len(index.tokens) : view.lengths[b]].tolist())


class HeadCache:
    """The KV cache of a stateful head during one generate call. Its slots mirror the shared cache: the prompt
    goes in after prefill, each drafted input as the drafter runs it, and after verification it is cut back like
    the shared cache and given the verified inputs it has not seen (for context="top": all of this step's
    verified inputs again, as final-layer states in place of the layer-E states it drafted from; for a fused
    head: all of them again, fused with the verifier's final states in place of its own estimates). Every pass
    of the head runs through the loop's runner (`run_own`: compiled where the step is), over a buffer the runner
    sized like the shared cache's."""

    def __init__(self, head: ExitHead, cache: SpecCache):
        self.head, self.cache = head, cache

    @classmethod
    def after_prompt(cls, head: ExitHead, view, prompt) -> "HeadCache":
        """The head's cache for a call, holding the prompt (`prompt`: the drafter's PromptStates)."""
        if prompt.exit_layer != head.exit_layer:
            raise ValueError(f"The prefill ran to layer {prompt.exit_layer}, but the head exits at "
                             f"layer {head.exit_layer}; set config.exit_layer to the head's layer.")
        new = cls(head, view.own_cache())
        if new.fuses:  # each prompt position fused with the final state before it (none before position 0)
            prev = previous_top(prompt.top).masked_fill((prompt.positions == 0)[..., None], 0.0)
            new.feed(view, prompt.early, prompt.positions, prev)
        else:
            new.feed(view, prompt.top if head.context == "top" else prompt.early, prompt.positions)
        return new

    @property
    def fuses(self) -> bool:
        """A fused head: its layer reads fused states (heads.FusedHead), which the cache is fed with."""
        return self.head.reads_top

    def feed(self, runner, hidden: torch.Tensor, positions: torch.Tensor, prev: torch.Tensor | None = None,
             tree: torch.Tensor | None = None) -> torch.Tensor:
        """Run the head on (B, T, H) states entering the next T slots, through `runner` (the loop's DraftView, or a
        Runner in the warm-up: anything with `run_own`); `prev` (B, T, H): the final states a fused head fuses them
        with; `tree`: the step's ancestor matrix while it drafts a tree. Returns the layer's (B, T, H) output, for a
        fused head its normed output."""
        weight = next(self.head.layer.parameters())
        hidden, positions = hidden.to(weight.device, weight.dtype), positions.to(weight.device)
        like = self.head.source_layer
        if self.fuses:
            return runner.run_own(fused_pass, self.head, like, self.cache, positions, hidden,
                                  prev.to(weight.device, weight.dtype), tree=tree)
        return runner.run_own(layer_pass, self.head, like, self.cache, positions, hidden, tree=tree)

    def catch_up(self, view, step, last_top: torch.Tensor | None = None) -> None:
        """After verification: cut back to the verified prefix and feed what `step` (a VerifyStep) verified
        (`last_top` (B, H): a fused head's final state of the position before the step)."""
        verified_len = view.verified_len
        prev = None
        if self.fuses or self.head.context == "top" or step.kept is not None:  # after a tree: its path, in order
            self.cache.rollback(step.base)
            if self.fuses:
                prev = torch.cat([last_top[:, None].to(step.top.dtype), step.top[:, :-1]], dim=1)
                source = step.early
            else:
                source = step.top if self.head.context == "top" else step.early
        else:
            self.cache.rollback(verified_len)
            source = step.early
        start = self.cache.layer_length(0)
        if start < verified_len:
            cols = slice(start - step.base, verified_len - step.base)
            self.feed(view, source[:, cols], step.positions[:, cols], None if prev is None else prev[:, cols])
