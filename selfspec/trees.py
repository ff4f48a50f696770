"""Draft trees as small pure functions.

A tree draft of N nodes per row: `tokens` (B, N) and `parents` (B, N). The verify pass sees N + 1 inputs per row:
input 0 is the root (the pending token, already emitted), input i + 1 is node i. parents[b, i] is the *input* index
of node i's parent, so 0 means a child of the root. Nodes come in a topological order (parents[b, i] <= i: a parent
before its children) and siblings in the order verification tries them. A chain is the tree parents[b, i] = i.
"""
from __future__ import annotations

import math

import torch

from .sampling import logits_to_probs, sample


def chain_parents(batch: int, n: int, device) -> torch.Tensor:
    """(B, N) parents of a chain: node i hangs under input i."""
    return torch.arange(n, device=device)[None, :].expand(batch, n)


def tree_ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """(B, N) parents -> (B, N + 1, N + 1) bool; [b, i, j]: input j is input i or one of its ancestors.

    `depth` bounds the depth of any node. The parent relation is closed by repeated squaring of the
    (input, ancestor) reachability matrix: ceil(log2(depth)) small batched matmuls, no host sync."""
    b, n = parents.shape
    m = n + 1
    reach = torch.eye(m, device=parents.device).expand(b, m, m).clone()
    nodes = torch.arange(1, m, device=parents.device)[None, :].expand(b, n)
    reach[torch.arange(b, device=parents.device)[:, None], nodes, parents] = 1.0
    for _ in range(math.ceil(math.log2(depth)) if depth > 1 else 0):
        reach = (reach @ reach).clamp_(max=1.0)
    return reach.bool()


def input_depths(ancestors: torch.Tensor) -> torch.Tensor:
    """(B, M, M) ancestor matrix -> (B, M) depth of each input (root 0): its proper ancestors counted."""
    return ancestors.sum(-1) - 1


def verify_tree_greedy(tokens, parents, logits_at, draft_len, depth: int):
    """Walk down from the root while a child of the current node is the target's argmax there.

    tokens, parents (B, N); draft_len (B,) nodes proposed per row (a prefix in node order); logits_at(current)
    -> (B, V) the target's processed logits at verify inputs `current` (B,), asked for along the walk only.
    Returns path (B, D + 1) input indices (root first, 0 past a row's end), n (B,) accepted nodes, token (B,) the
    target's argmax after the last accepted node, and the path's logits (B, D + 1, V); D <= depth is the longest
    accepted path. Among equal siblings the first in node order is taken."""
    proposed = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < draft_len[:, None]
    current = torch.zeros_like(draft_len)
    walking = torch.ones_like(draft_len, dtype=torch.bool)
    path, seen = [current], []
    for level in range(depth + 1):
        seen.append(logits_at(current))
        target = seen[-1].argmax(dim=-1)
        if level == depth:
            break
        match = (parents == current[:, None]) & (tokens == target[:, None]) & proposed  # (B, N)
        walking = walking & match.any(dim=1)
        if not bool(walking.any()):  # one host check per level: the path is as long as the longest accepted
            break
        child = match.float().argmax(dim=1) + 1
        current = torch.where(walking, child, current)
        path.append(torch.where(walking, child, 0))
    n = (torch.stack(path[1:], dim=1) > 0).sum(dim=1) if len(path) > 1 else torch.zeros_like(current)
    return torch.stack(path, dim=1), n, target, torch.stack(seen[: len(path)], dim=1)


def verify_tree_sampling(tokens, parents, logits_at, draft_len, depth: int, q=None):
    """Multi-candidate speculative sampling over a tree (SpecInfer's multi-step speculative sampling): the output
    follows the target's distribution p exactly.

    From the root, the children of the current node are tried in node order: child x, drafted from q_x, is
    accepted with probability min(1, r(x) / q_x(x)), where r starts as p at the current node and becomes
    norm(max(0, r - q_x)) after each rejected sibling. An accepted child becomes the current node; when every
    child is rejected, or the node has none, the verifier's token is sampled from r.

    logits_at as for verify_tree_greedy (p = softmax of them); q: (B, N, V) the distribution each node was drafted
    from, or None for deterministic drafts (a point mass: accepted with probability r(x), removed from r when
    rejected). Returns path, n, token, path logits like verify_tree_greedy."""
    b, n_nodes = tokens.shape
    u = torch.rand(b, n_nodes, device=tokens.device)  # each node is tried at most once
    on_host = tokens.device.type == "cpu"  # where asking whether any row tries a node costs no device sync
    current = torch.zeros_like(draft_len)
    seen = [logits_at(current)]
    residual = logits_to_probs(seen[0])  # (B, V)
    walking = torch.ones_like(draft_len, dtype=torch.bool)
    path = [current]
    for _ in range(depth):
        moved, child = torch.zeros_like(walking), torch.zeros_like(current)
        for i in range(n_nodes):  # topological order: the children of `current` in the order they are tried
            x = tokens[:, i]
            tried = walking & ~moved & (parents[:, i] == current) & (i < draft_len)
            if on_host and not bool(tried.any()):  # most nodes are no child of the current one: no (B, V) work
                continue
            q_i = None if q is None else q[:, i]
            q_x = torch.ones_like(u[:, i]) if q_i is None else q_i.gather(1, x[:, None])[:, 0]
            take = tried & (u[:, i] * q_x < residual.gather(1, x[:, None])[:, 0])
            rejected = tried & ~take
            residual = torch.where(rejected[:, None], residual_after_rejection(residual, x, q_i), residual)
            moved, child = moved | take, torch.where(take, i + 1, child)
        walking = moved
        if not bool(walking.any()):
            break
        current = torch.where(walking, child, current)
        path.append(torch.where(walking, child, 0))
        seen.append(logits_at(current))
        residual = torch.where(walking[:, None], logits_to_probs(seen[-1]), residual)
    n = (torch.stack(path[1:], dim=1) > 0).sum(dim=1) if len(path) > 1 else torch.zeros_like(current)
    return torch.stack(path, dim=1), n, sample(residual), torch.stack(seen, dim=1)


def residual_after_rejection(r: torch.Tensor, x: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """norm(max(0, r - q)) for (B, V) r and q (a point mass on x (B,) when q is None). An empty residual
    (r <= q everywhere: the draft could not have been rejected) leaves r as it was."""
    if q is None:
        q = torch.zeros_like(r).scatter_(1, x[:, None], 1.0)
    left = torch.clamp(r - q, min=0.0)
    mass = left.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, left / mass.clamp(min=1e-30), r)


def gather_inputs(x: torch.Tensor, path: torch.Tensor) -> torch.Tensor:
    """(B, N + 1, ...) values per verify input -> (B, D, ...) along (B, D) path input indices."""
    index = path.view(*path.shape, *([1] * (x.dim() - 2))).expand(*path.shape, *x.shape[2:])
    return x.gather(1, index)


def merge_branches(branches: list[list[int]], size: int, base: tuple[list[int], list[int]] = ((), ())
                   ) -> tuple[list[int], list[int]]:
    """Token chains that all start at the root -> (tokens, parents) of their trie, at most `size` nodes: chains
    sharing a prefix share its nodes, nodes come in chain order (each chain's new nodes after the earlier ones),
    so parents precede children and earlier chains are tried first.

    base: a tree (tokens, parents) to graft the chains onto: its nodes come first, unchanged, and a chain follows
    them as far as they hold its tokens, so no node gets two children of the same token (the second would be
    verified for nothing: greedy takes the first, and sampling has removed its token from the residual)."""
    tokens, parents = list(base[0]), list(base[1])
    index: dict[tuple[int, int], int] = {}  # (parent input, token) -> input index
    for i in reversed(range(len(tokens))):  # reversed: of equal siblings in a base, the first is the one tried
        index[(parents[i], tokens[i])] = i + 1
    for chain in branches:
        parent = 0
        for token in chain:
            if (parent, token) not in index:
                if len(tokens) == size:
                    break
                tokens.append(token)
                parents.append(parent)
                index[(parent, token)] = len(tokens)
            parent = index[(parent, token)]
    return tokens, parents


def pack_trees(trees: list[tuple[list[int], list[int]]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (tokens, parents) lists -> tokens (B, N), parents (B, N), draft_len (B,); rows with fewer nodes
    are padded with nodes under the root that verification never tries (they lie past draft_len)."""
    width = max((len(t) for t, _ in trees), default=0)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    parents = torch.zeros_like(tokens)
    for row, (t, p) in enumerate(trees):
        tokens[row, : len(t)] = torch.tensor(t, dtype=torch.long)
        parents[row, : len(p)] = torch.tensor(p, dtype=torch.long)
    draft_len = torch.tensor([len(t) for t, _ in trees], dtype=torch.long)
    return tokens.to(device), parents.to(device), draft_len.to(device)
