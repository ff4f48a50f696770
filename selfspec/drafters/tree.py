"""Grow a draft tree from a head's distribution (EAGLE-2's dynamic tree) on the shared early-exit cache.

Level by level, the frontier (the best `top_k` nodes of the newest level by cumulative draft log-probability,
and with a confidence threshold only those whose cumulative probability reaches it) runs through layers [0, E)
and the head under the tree mask, so its KV is the verifier's own, as for a chain.
Each frontier node offers its `top_k` most probable children; after `depth` levels, or when `size` nodes are
run, the tree keeps every run node and fills up to `size` nodes with the best remaining children (leaves),
which the verifier runs through [0, E) itself. Keeping the run nodes keeps the tree closed under ancestors
(every leaf hangs under a run node). Nodes are ordered run nodes first (their cache slots), then leaves.
Children are deterministic (top-k, not sampled), so in sampling mode each is a point-mass draft.
"""
from __future__ import annotations

import math

import torch

from ..draft_logits import DraftLogits
from ..trees import tree_ancestors
from .base import Draft


def grow_tree(view, run_level, depth: int, top_k: int, size: int, threshold: float = 0.0) -> Draft:
    """run_level(inputs (B, F), positions (B, F), parents (B, F) or None, tree) -> (layer-E states (B, F, H), draft
    logits (B, F, V) or a head's DraftLogits at (B, F)); parents are the inputs' parents' verify-input indices, None
    for the root, and tree the ancestor matrix of the step's inputs so far (view.run_early masks with it).
    Returns a tree Draft of at most `size` nodes and `depth` levels per row (parents, hidden, no q).

    threshold: the chain's confidence rule for trees: a level runs only the children whose cumulative draft
    probability reaches it (as many as the row with most has), so growth stops once no row has one, and leaves
    below it are left out (likewise). A node below it is unlikely to be accepted and costs a slot in every level
    pass and in the verify pass, which on a CPU grow by about 5 % of a step per token."""
    b, device = view.batch, view.device
    run_tokens = torch.empty(b, 0, dtype=torch.long, device=device)
    run_parents = torch.empty_like(run_tokens)
    frontier = view.pending[:, None]  # (B, F) tokens of the nodes to run next
    frontier_inputs = torch.zeros(b, 1, dtype=torch.long, device=device)  # their verify-input indices
    frontier_score = torch.zeros(b, 1, device=device)  # cumulative draft log-probability
    frontier_parents = None  # the root's parent is the verified prefix
    hiddens, leaves = [], []
    for level in range(1, depth + 1):
        positions = (view.pos[:, None] + (level - 1)).expand_as(frontier)
        hidden, logits = run_level(frontier, positions, frontier_parents, tree_ancestors(run_parents, level))
        hiddens.append(hidden)
        top_logp, top_tokens = ranked_children(view, logits, top_k)  # (B, F, top_k)
        score = (frontier_score[..., None] + top_logp).flatten(1)  # (B, F * top_k)
        tokens = top_tokens.flatten(1)
        parents = frontier_inputs[..., None].expand(-1, -1, top_k).flatten(1)
        width = frontier_width(level, depth, top_k, size, run_tokens.shape[1])
        if width > 0:  # counting what reaches the threshold costs a device sync: not at the last level
            width = min(width, reaching(score, threshold))
        if width > 0:  # nothing is drafted after an EOS, so an EOS child is expanded last
            pick = score.masked_fill(view.is_eos(tokens), float("-inf")).topk(width, dim=-1).indices
            frontier, frontier_score = tokens.gather(1, pick), score.gather(1, pick)
            frontier_inputs = run_tokens.shape[1] + 1 + torch.arange(width, device=device)[None, :].expand(b, -1)
            run_tokens = torch.cat([run_tokens, frontier], dim=1)
            frontier_parents = parents.gather(1, pick)
            run_parents = torch.cat([run_parents, frontier_parents], dim=1)
            score = score.scatter(1, pick, float("-inf"))  # the frontier is no leaf
        leaves.append((tokens, parents, score))
        if width == 0:
            break
    tokens, parents = _with_best_leaves(run_tokens, run_parents, leaves, size, threshold)
    draft_len = torch.full((b,), tokens.shape[1], dtype=torch.long, device=device).masked_fill(view.finished, 0)
    return Draft(tokens=tokens, draft_len=draft_len, hidden=torch.cat(hiddens, dim=1),
                 parents=parents if tokens.shape[1] else None)


def ranked_children(view, logits, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A level's draft logits -> each node's top_k children: (log-probabilities, tokens) (B, F, top_k), best first.
    Without logits processors a head's DraftLogits ranks its own columns; otherwise the processed full rows."""
    if isinstance(logits, DraftLogits):
        if not view.settings.processors:
            return logits.top_k(top_k)
        logits = logits.full()
    return torch.log_softmax(view.process(logits), dim=-1).topk(top_k, dim=-1)


def frontier_width(level: int, depth: int, top_k: int, size: int, run: int) -> int:
    """Nodes of level `level` (1-based: the root's children) to run through [0, E) and expand, when `run` nodes
    already were: top_k while they fit in `size`, none at the last level. The one statement of the tree's shape;
    the cost model's replay (tools.cost_model._tree_block) runs it too."""
    return min(top_k, size - run) if level < depth else 0


def earns_slot(score, threshold: float):
    """Whether a node of this cumulative draft log-probability (a float, or elementwise a tensor of them) earns a
    slot in the tree: it reaches the threshold, and it is not ruled out (-inf: a token the processors forbid, or a
    child already taken). The grower and the cost model's replay (tools.cost_model) count nodes with it."""
    floor = math.log(threshold) if threshold > 0 else -math.inf
    return (score >= floor) & (score > -math.inf)


def reaching(score: torch.Tensor, threshold: float) -> int:
    """How many of a level's nodes, (B, M) cumulative log-probabilities, earn a slot in the row that has most."""
    return int(earns_slot(score, threshold).sum(dim=1).max())


def _with_best_leaves(run_tokens, run_parents, leaves, size: int, threshold: float):
    """Append the best size - (run nodes) leaves by cumulative score, most probable first (the order in which
    sampling tries siblings); with a threshold, only as many as the row with most leaves above it has."""
    tokens, parents, score = (torch.cat(parts, dim=1) for parts in zip(*leaves))
    count = min(size - run_tokens.shape[1], reaching(score, threshold))
    pick = score.topk(count, dim=-1).indices
    return (torch.cat([run_tokens, tokens.gather(1, pick)], dim=1),
            torch.cat([run_parents, parents.gather(1, pick)], dim=1))
