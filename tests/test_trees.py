"""Draft trees: the pure functions on hand-made trees, greedy identity against Hugging Face's own output for every
family, exit layer and tree shape (batches and every head design included), the chain fallbacks with their
warnings, and the config's checks. Sampling exactness is in test_drafters (the "tree" case and its negative
control)."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers.generation import logits_process as lp

import selfspec
from conftest import FAMILIES, make_model, padded_batch, prompt
from selfspec.sampling import verify_greedy
from selfspec.trees import chain_parents, input_depths, tree_ancestors, verify_tree_greedy
from test_heads import KINDS, _heads

GEN = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
SHAPES = [(3, 2, 6), (4, 3, 9), (5, 4, 16)]  # (depth K, top_k, size)

# input 0 is the root; nodes 0..4 are inputs 1..5:  root -> {1, 2}, 1 -> {3, 5}, 3 -> {4}
PARENTS = torch.tensor([[0, 0, 1, 3, 1]])


def _one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    """(1, len, V) logits whose argmax at input i is targets[i]."""
    return torch.nn.functional.one_hot(torch.tensor([targets]), vocab).double()


def test_ancestors_and_depths_of_a_hand_made_tree():
    anc = tree_ancestors(PARENTS, depth=3)
    assert anc[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]  # node 3 (input 4): root, 1, 3, itself
    assert anc[0, 5].nonzero().flatten().tolist() == [0, 1, 5]
    assert input_depths(anc)[0].tolist() == [0, 1, 1, 2, 3, 2]
    # a depth bound below the true depth leaves ancestors out: the bound is load-bearing
    assert not bool(tree_ancestors(PARENTS, depth=1)[0, 4, 0])


def test_greedy_walk_takes_the_right_sibling_and_stops_at_the_first_miss():
    tokens = torch.tensor([[5, 6, 7, 1, 2]])
    # target after root: 6 (node 1, input 2, no children) -> accept 1 node, then the target there is 3
    path, n, token, _ = verify_tree_greedy(tokens, PARENTS, lambda cur: _one_hot_logits([6, 0, 3, 0, 0, 0])[0, cur],
                                           torch.tensor([5]), depth=3)
    assert (n.item(), token.item(), path[0].tolist()) == (1, 3, [0, 2])
    # targets 5 at the root (node 0, input 1), 7 there (node 2, input 3, not its sibling 2 at input 5), 1 there
    # (node 3, input 4), and 4 after it
    targets = [5, 7, 0, 1, 4, 0]
    path, n, token, logits = verify_tree_greedy(tokens, PARENTS, lambda cur: _one_hot_logits(targets)[0, cur],
                                                torch.tensor([5]), depth=3)
    assert (n.item(), token.item(), path[0].tolist()) == (3, 4, [0, 1, 3, 4])
    assert logits.argmax(-1)[0].tolist() == [5, 7, 1, 4]  # the logits the loop records, along the path
    # nodes past draft_len are not proposed: with 3 of them the walk stops before node 3
    path, n, token, _ = verify_tree_greedy(tokens, PARENTS, lambda cur: _one_hot_logits(targets)[0, cur],
                                           torch.tensor([3]), depth=3)
    assert (n.item(), token.item()) == (2, 1)


def test_a_chain_shaped_tree_verifies_like_the_chain():
    with torch.device("cpu"):  # pure functions on CPU tensors, also in a run on a GPU
        _chain_shaped_trees_verify_like_chains()


def _chain_shaped_trees_verify_like_chains():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b, k, v = 4, 5, 6
        tokens = torch.randint(0, v, (b, k), generator=g)
        logits = torch.randn(b, k + 1, v, generator=g)
        logits.scatter_(2, torch.cat([tokens, tokens[:, :1]], 1)[..., None], 5.0 * torch.rand(b, k + 1, 1, generator=g))
        draft_len = torch.randint(0, k + 1, (b,), generator=g)
        rows = torch.arange(b)
        _, n, token, _ = verify_tree_greedy(tokens, chain_parents(b, k, "cpu"), lambda c: logits[rows, c],
                                            draft_len, depth=k)
        n_ref, token_ref = verify_greedy(tokens, logits, draft_len)
        assert torch.equal(n, n_ref) and torch.equal(token, token_ref)


def _generate(model, ids, mask=None, **cfg):
    selfspec.wrap(model, **cfg)
    try:
        return model.generate(ids, attention_mask=mask, **GEN), model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_identity_every_family_and_shape(family):
    model = make_model(family, 4)
    ids = prompt(seed=1)
    ref = model.generate(ids, **GEN)
    for exit_layer in (1, 3):
        for k, top_k, size in SHAPES:
            out, stats = _generate(model, ids, exit_layer=exit_layer, max_draft_tokens=k, draft_tree_top_k=top_k,
                                   draft_tree_size=size)
            assert torch.equal(out, ref), (family, exit_layer, k, top_k, size)
            assert stats.drafted_tokens > stats.verify_steps, stats  # trees were drafted, not chains


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "qwen3"])
def test_greedy_identity_padded_batch(family):
    """Rows of different lengths, each with its own tree and accepted path, in one pass; with a confidence
    threshold, trees that stop growing early or have no nodes at all."""
    model = make_model(family, 4)
    ids, mask = padded_batch(seed=2)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    for exit_layer, (k, top_k, size), threshold in ((1, SHAPES[1], 0.0), (2, SHAPES[2], 0.0), (2, SHAPES[2], 0.3)):
        out, _ = _generate(model, ids, mask, exit_layer=exit_layer, max_draft_tokens=k, draft_tree_top_k=top_k,
                           draft_tree_size=size, draft_confidence_threshold=threshold)
        assert torch.equal(out, ref), (family, exit_layer, k, threshold)


@pytest.mark.parametrize("drafter", ["early_exit", "hybrid"])
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_identity_with_each_head(kind, drafter):
    """Heads with a KV cache of their own (attention adapters) draft over the tree and follow its path; heads
    that read final states get them through trees, chains and the hybrid's n-gram prefixes alike."""
    model = make_model("llama", 4)
    ids, mask = padded_batch(seed=3)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    for top_k in (1, 3):
        selfspec.wrap(model, exit_layer=2, max_draft_tokens=4, draft_tree_top_k=top_k, draft_tree_size=10,
                      drafter=drafter, hybrid_min_match=1)
        model.selfspec.add_head(_heads(model=model)[kind])
        try:
            assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref), top_k
        finally:
            selfspec.unwrap(model)


def test_a_tree_accepts_more_than_its_chain_on_a_flat_model():
    """On a random model the draft's top choice is often wrong and its second one right: the tree must find
    those (a tree that only ever followed its first branch would tie the chain)."""
    model = make_model("llama", 4, agreeable=False)
    ids = prompt(seed=4)
    _, chain = _generate(model, ids, exit_layer=3, max_draft_tokens=4)
    _, tree = _generate(model, ids, exit_layer=3, max_draft_tokens=4, draft_tree_top_k=4, draft_tree_size=16)
    assert tree.mean_accepted_tokens > 1.2 * chain.mean_accepted_tokens, (tree, chain)


def _grown(probs_per_level: list[list[float]], threshold: float, top_k: int = 3, size: int = 12, depth: int = 3):
    """grow_tree on one row whose every node at depth d has the draft distribution probs_per_level[d] (over a
    vocabulary of that length): the run nodes per level and the tree's nodes. A CPU state, so on the CPU whatever
    the test device."""
    from types import SimpleNamespace

    from selfspec.drafters.tree import grow_tree

    run = []

    def run_level(inputs, positions, parents, tree):  # (1, F) -> states (1, F, 4), logits (1, F, V)
        level = len(run)
        run.append(inputs.shape[1])
        logp = torch.tensor(probs_per_level[level]).log()
        return torch.zeros(1, inputs.shape[1], 4), logp.expand(1, inputs.shape[1], -1)

    with torch.device("cpu"):
        state = SimpleNamespace(batch=1, device=torch.device("cpu"), pending=torch.tensor([0]), pos=torch.tensor([5]),
                                finished=torch.tensor([False]), process=lambda x: x,
                                is_eos=lambda t: torch.zeros_like(t, dtype=torch.bool))
        draft = grow_tree(state, run_level, depth, top_k, size, threshold)
    return run, draft.tokens.shape[1]


def test_a_threshold_runs_only_the_nodes_that_reach_it():
    """Children below the threshold by cumulative draft probability are neither run through [0, E) nor kept:
    under a root whose children are 0.6 / 0.3 / 0.1 and threshold 0.2, level 2 runs the first two, and of their
    grandchildren (0.36, 0.18, 0.06, 0.18, ...) only 0.36 reaches it, and of its children (the last level,
    leaves) only 0.216. Without a threshold every top-3 node runs."""
    probs = [[0.6, 0.3, 0.1, 0.0], [0.6, 0.3, 0.1, 0.0], [0.6, 0.3, 0.1, 0.0]]
    assert _grown(probs, 0.2) == ([1, 2, 1], 4)  # run: root, (0.6, 0.3), (0.36); nodes: those 3 and 0.216
    assert _grown(probs, 0.0) == ([1, 3, 3], 12)  # 6 run, 6 best leaves of the 9 under the last level


# the fallback warning each case should give: a drafter of chains only, a processor that reads the prefix; and
# none for drafter="none", plain decoding through the engine (the calibrator's and bench's baselines run it over a
# tree config), which has no tree to fall back from
FALLBACK_WARNING = {"draft-model": "'model' drafter drafts chains only", "penalty": "RepetitionPenaltyLogitsProcessor",
                    "none": None}


@pytest.mark.parametrize("case", sorted(FALLBACK_WARNING))
def test_chains_with_a_warning_where_a_tree_cannot_run(case):
    model = make_model("llama", 4)
    ids = prompt(seed=5, length=16)
    extra = {"draft-model": dict(drafter=make_model("llama", 1, seed=5)), "none": dict(drafter="none")}.get(case, {})
    gen = dict(GEN, repetition_penalty=1.3) if case == "penalty" else GEN
    ref = model.generate(ids, **gen)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=3, draft_tree_top_k=2, draft_tree_size=6, **extra)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(ids, **gen)
    finally:
        selfspec.unwrap(model)
    assert torch.equal(out, ref)
    fallbacks = [str(w.message) for w in caught if "instead of trees" in str(w.message)]
    expected = FALLBACK_WARNING[case]
    assert any(expected in m for m in fallbacks) if expected else not fallbacks, [str(w.message) for w in caught]


def test_config_checks_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="draft_tree_top_k must be an integer >= 1"):
        selfspec.SelfSpecConfig(draft_tree_top_k=0).validate()
    with pytest.raises(ValueError, match="draft_tree_size must be an integer >= max_draft_tokens=6"):
        selfspec.SelfSpecConfig(draft_tree_top_k=2, draft_tree_size=4).validate()
    config = selfspec.SelfSpecConfig(draft_tree_top_k=3, draft_tree_size=12)
    config.save(str(tmp_path))
    loaded = selfspec.SelfSpecConfig.load(str(tmp_path))
    assert (loaded.draft_tree_top_k, loaded.draft_tree_size) == (3, 12)


def test_a_tree_larger_than_the_config_allows_is_refused():
    """The loop's side of the drafter contract for trees."""
    from selfspec.drafters.base import Draft, Drafter

    class Bushy(Drafter):
        name, drafts_trees = "bushy", True

        def propose(self, state, k):
            n = state.settings.tree_size + 1
            tokens = torch.zeros(state.batch, n, dtype=torch.long)
            return Draft(tokens, torch.full((state.batch,), n), parents=torch.zeros_like(tokens))

    model = make_model("llama", 4)
    selfspec.wrap(model, drafter=Bushy(), max_draft_tokens=2, draft_tree_top_k=2, draft_tree_size=4)
    try:
        with pytest.raises(ValueError, match="at most draft_tree_size=4 nodes"):
            model.generate(prompt(seed=6), **GEN)
    finally:
        selfspec.unwrap(model)


def test_merged_branches_share_their_prefixes():
    from selfspec.trees import merge_branches

    tokens, parents = merge_branches([[5, 6, 7], [5, 6, 9], [4], [5, 8]], size=10)
    assert tokens == [5, 6, 7, 9, 4, 8] and parents == [0, 1, 2, 2, 0, 1]
    assert merge_branches([[5, 6, 7], [4, 3]], size=4) == ([5, 6, 7, 4], [0, 1, 2, 0])  # cut at the size
    # grafted onto a tree (the hybrid's head tree: 5 and 4 under the root, 6 under 5), chains follow its nodes
    # while they hold their tokens and hang the rest below; the tree's own nodes stay first and unchanged
    base = ([5, 4, 6], [0, 0, 1])
    assert merge_branches([[5, 6, 7], [4, 8], [9]], size=10, base=base) == ([5, 4, 6, 7, 8, 9], [0, 0, 1, 3, 2, 0])
    assert merge_branches([[5, 6, 7, 1]], size=4, base=base) == ([5, 4, 6, 7], [0, 0, 1, 3])  # size counts the base


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_ngram_branches_and_hybrid_trees_stay_exact(drafter):
    """A prompt that repeats a phrase with different continuations: the n-gram drafter offers each as a branch
    (the hybrid adds the head's tree), in a padded batch, and greedy output stays HF's."""
    model = make_model("llama", 4)
    phrase = [11, 12, 13]
    row = phrase + [20, 21] + phrase + [30, 31] + phrase + [40, 41] + phrase
    ids = torch.tensor([row, [0] * 4 + row[4:]])
    mask = (ids != 0).long()
    ref = model.generate(ids, attention_mask=mask, **GEN)
    out, stats = _generate(model, ids, mask, drafter=drafter, exit_layer=2, max_draft_tokens=3, draft_tree_top_k=3,
                           draft_tree_size=10, hybrid_min_match=2)
    assert torch.equal(out, ref)
    assert stats.drafted_tokens > 0


def test_ngram_branches_are_the_recent_occurrences():
    from types import SimpleNamespace

    from selfspec.drafters.ngram import NgramDrafter

    seq = torch.tensor([[1, 2, 7, 8, 1, 2, 9, 1, 2, 7, 5, 1, 2]])
    state = SimpleNamespace(seq=seq, seq_len=torch.tensor([13]), lengths=[13], mask=None,
                            finished=torch.tensor([False]), is_eos=lambda t: torch.zeros_like(t, dtype=torch.bool))
    drafter = NgramDrafter(ngram_max=2)
    drafter.prompt_pad = None
    assert drafter.branches(state, 2, 3) == [[[7, 5], [9, 1], [7, 8]]]  # most recent "1 2" first
    assert drafter.branches(state, 2, 3, min_match=3) == [[]]  # only a 2-token suffix matches


def test_a_top_reading_head_reads_each_tree_nodes_parent():
    """A node's input state is its parent's head output, as if its branch were drafted as a chain: the tree's
    states at depth 2 equal the chain's along each branch (node 3 hangs under node 1, node 4 under node 2)."""
    from types import SimpleNamespace

    from selfspec.head_state import TopStates

    model = make_model("llama", 4)
    selfspec.wrap(model, exit_layer=2)
    adapter, head = model.selfspec.adapter, _heads()["mlp-top"]
    torch.manual_seed(1)
    last, root, level1, level2 = (torch.randn(2, t, 32, dtype=torch.float64) for t in (1, 1, 2, 2))
    prompt = SimpleNamespace(top=last)  # the PromptStates field a top-reading head starts from
    tree = TopStates()
    tree.begin(prompt)
    tree.normed(head, adapter, root, None)
    tree.normed(head, adapter, level1, torch.zeros(2, 2, dtype=torch.long))
    deep = tree.normed(head, adapter, level2, torch.tensor([[1, 2], [1, 2]]))
    for node in (0, 1):
        chain = TopStates()
        chain.begin(prompt)
        for h in (root, level1[:, node : node + 1], level2[:, node : node + 1]):
            out = chain.normed(head, adapter, h, None)
        assert torch.allclose(out[:, 0], deep[:, node])
    selfspec.unwrap(model)


@pytest.mark.parametrize("threshold,top_k,size,depth", [(0.2, 3, 12, 3), (0.05, 4, 14, 5), (0.0, 3, 10, 3),
                                                        (0.1, 2, 6, 4), (0.0, 2, 16, 2)])
def test_the_cost_models_tree_is_what_the_grower_grows(threshold, top_k, size, depth):
    """On a head whose distribution at each depth is known, the calibrator's replay (cost_model._tree_block) runs
    the levels and keeps the nodes grow_tree does, threshold included. (0.0, 2, 16, 2): a size larger than the
    levels offer (2 run, 4 leaves); the grower once filled it with its run nodes again, as leaves of -inf score.)"""
    from selfspec.tools import cost_model

    probs = [[0.5, 0.3, 0.15, 0.05], [0.7, 0.2, 0.1, 0.0], [0.4, 0.4, 0.1, 0.1], [0.9, 0.05, 0.05, 0.0],
             [0.6, 0.3, 0.1, 0.0]][:depth]
    run, nodes = _grown(probs, threshold, top_k, size, depth)
    n = len(probs)
    widths, replayed, _ = cost_model._tree_block(probs, [0] * n, [p[0] for p in probs], 0, depth, top_k, size,
                                                 threshold, [False] * n)
    assert (widths, replayed) == (run, nodes)
