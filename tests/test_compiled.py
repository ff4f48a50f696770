"""The compiled step (selfspec/compiled.py): Hugging Face's greedy tokens, and no recompilation after the warm-up."""
from __future__ import annotations

import pytest
import torch
from conftest import TEST_DEVICE, make_model, padded_batch, prompt
from torch._dynamo.utils import counters

import selfspec
from selfspec import compiled

GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo counts a function's graphs against its recompile limit over the whole process, whichever model made
    them: each test here starts from none, so that what it counts is its own."""
    torch._dynamo.reset()
    yield


def _plain(model, ids, mask=None):
    return model.generate(ids, attention_mask=mask, **GEN)


def _graphs() -> int:
    """Frames Dynamo has compiled in this process so far (one per graph, recompilations included)."""
    return counters["frames"]["ok"]


# the other families repeat llama's checks through their own adapters, one graph per layer range (fewer to compile)
@pytest.mark.parametrize("family,dynamic", [("llama", False), ("llama", True),
                                            pytest.param("mistral", True, marks=pytest.mark.slow),
                                            pytest.param("gpt2", True, marks=pytest.mark.slow),
                                            pytest.param("gpt_neox", True, marks=pytest.mark.slow)])
def test_compiled_greedy_is_hugging_faces_in_float32(family, dynamic, monkeypatch):
    # no exact buckets: every verify pass of K + 1 = 5 tokens runs padded to 8 rows (dynamic: at its own 5 rows)
    monkeypatch.setattr(compiled.CompiledStep, "fit", lambda self, *sizes: None)
    model = make_model(family, dtype=torch.float32)
    ids, (batch, mask) = prompt(seed=11, length=12), padded_batch(seed=12)
    plain_one, plain_batch = _plain(model, ids), _plain(model, batch, mask)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4, compile=True)
    compiled.step_for(model, model.device).dynamic_tokens = dynamic
    try:
        assert torch.equal(_plain(model, ids), plain_one)
        assert model.selfspec.last_stats.accepted_tokens > 0  # drafts were verified, some accepted
        assert torch.equal(_plain(model, batch, mask), plain_batch)
        assert compiled.warmup_seconds(model) > 0  # the passes did run compiled
    finally:
        selfspec.unwrap(model)


def _trained_like_head(model, copy_max: int = 0):
    """A top-reading MLP head at layer 2 over most of the vocabulary, near the plain exit (so drafts get accepted)
    but depending on every weight it has: what the compiled head must reproduce."""
    from selfspec.heads import MLPHead

    torch.manual_seed(5)
    hidden = model.config.hidden_size
    vocab = torch.arange(model.config.vocab_size)[torch.randperm(model.config.vocab_size) % 8 != 0].sort().values
    head = MLPHead(2, hidden, 2 * hidden, vocab_ids=vocab, context="top", copy_max=copy_max)
    for w in (head.down.weight, head.top_in.weight):
        torch.nn.init.normal_(w, std=0.001)  # more and no draft of this model is accepted
    return head.to(model.dtype)


@pytest.mark.parametrize("tree", [1, 3])
def test_compiled_heads_draft_what_eager_heads_draft(tree):
    """The exit head's MLP and its draft-vocabulary rows run compiled: the same drafts as eager (equal counts of
    drafted and accepted tokens) and Hugging Face's tokens, chains and trees."""
    model = make_model("llama", dtype=torch.float32)
    ids = prompt(seed=13, length=10)
    plain = _plain(model, ids)
    runs = {}
    for compile_ in (False, True):
        selfspec.wrap(model, exit_layer=2, max_draft_tokens=4, draft_tree_top_k=tree, draft_tree_size=6,
                      compile=compile_)
        model.selfspec.add_head(_trained_like_head(model))
        try:
            out = _plain(model, ids)
            stats = model.selfspec.last_stats
            runs[compile_] = (out, stats.drafted_tokens, stats.accepted_tokens)
        finally:
            selfspec.unwrap(model)
    assert torch.equal(runs[True][0], plain) and torch.equal(runs[False][0], plain)
    assert runs[True][2] > 0, "no draft was accepted: the comparison would not see a wrong draft"
    assert runs[True][1:] == runs[False][1:]
    seen = {key[0] for key in compiled.step_for(model, model.device)._seen}
    assert {"head", "rows"} <= seen, seen  # the head did run compiled


def _stateful_head(model, kind: str):
    """A fused head with its layer mixed in (drafts of its own), or a top-context attention head, at layer 2."""
    from selfspec.heads import AttentionHead, FusedHead

    adapter = selfspec.arch.adapter_for(model)
    if kind == "attn":
        return AttentionHead.from_model(adapter, 2, context="top")
    head = FusedHead.from_model(adapter, 2)
    with torch.no_grad():
        head.mix.fill_(1.0)
    return head


# a tree's shapes and the attention head repeat the fused chain's checks: slow
@pytest.mark.parametrize("kind,tree", [("fused", 1), pytest.param("fused", 3, marks=pytest.mark.slow),
                                       pytest.param("attn", 1, marks=pytest.mark.slow)])
def test_a_stateful_heads_own_passes_run_compiled(kind, tree):
    """A fused or attention head's own layer runs compiled over its own cache's buffer (Runner.run_own), drafting and
    catching up after verification: the same drafts as in eager decoding (equal drafted and accepted counts) and
    Hugging Face's tokens. For the fused chain, warmup() first compiles its own passes with the rest, each in one
    graph, and the call after it compiles nothing; it runs with one graph per pass kind (dynamic tokens), which
    compiles in a third of the time, and the slow cases run at the static buckets."""
    model = make_model("llama", dtype=torch.float32)
    ids = prompt(seed=13, length=10)
    plain = _plain(model, ids)
    head = _stateful_head(model, kind)
    runs = {}
    for compile_ in (False, True):
        selfspec.wrap(model, exit_layer=2, max_draft_tokens=4, draft_tree_top_k=tree, draft_tree_size=6,
                      compile=compile_)
        model.selfspec.add_head(head)
        try:
            counters.clear()
            if compile_ and (kind, tree) == ("fused", 1):
                compiled.step_for(model, model.device).dynamic_tokens = True
                assert model.selfspec.warmup(progress=False) > 0
            warm = _graphs()
            out = _plain(model, ids)
            runs[compile_] = (out, model.selfspec.last_stats.drafted_tokens, model.selfspec.last_stats.accepted_tokens)
        finally:
            selfspec.unwrap(model)
    assert torch.equal(runs[True][0], plain) and torch.equal(runs[False][0], plain)
    assert runs[True][2] > 0 and runs[True][1:] == runs[False][1:]
    step = compiled.step_for(model, model.device)
    own = {key[2:] for key in step._seen if key[0] == "own"}  # (head, batch, size)
    assert len(own) >= (1 if step.dynamic_tokens else 2), step._seen  # a draft's token, the catch-up's inputs
    if warm:
        assert _graphs() == warm, "a call compiled a pass shape the warm-up missed"
    assert _graphs() == len(step._seen), "a pass recompiled, or a graph broke in two"


def test_a_head_whose_weights_changed_runs_eager():
    model = make_model("llama", dtype=torch.float32)
    head = _trained_like_head(model)
    head = head.to(model.device)
    step = compiled.CompiledStep(model.device)
    hidden, prev = (torch.randn(1, 1, model.config.hidden_size, device=model.device) for _ in range(2))
    adapter = selfspec.wrap(model, exit_layer=2).selfspec.adapter
    try:
        with torch.no_grad():
            first = step.head_normed(head, adapter, hidden, prev)
            assert torch.allclose(first, head.normed_eager(hidden, adapter, prev), atol=1e-5)
            head.down.weight.mul_(2)  # the graph holds the weights as compiled
            assert step.head_normed(head, adapter, hidden, prev) is None
    finally:
        selfspec.unwrap(model)


def test_short_memory_shares_graphs_and_says_so(monkeypatch):
    model = make_model("llama", dtype=torch.float32)
    if model.device.type != "cpu":
        pytest.skip("the copies are a CPU's (Inductor's freezing)")
    monkeypatch.setattr(compiled, "_available_memory", lambda: 1e9)
    assert not compiled.step_for(model, model.device).dynamic_tokens  # a tiny model's 8 copies fit in 1 GB
    other = make_model("llama", dtype=torch.float32)
    monkeypatch.setattr(compiled, "_available_memory", lambda: 1e3)
    with pytest.warns(UserWarning, match="do not fit in the 0.0 GB available, so every pass of a layer range shares"):
        assert compiled.step_for(other, other.device).dynamic_tokens


# one graph per pass shape (False, the default where memory allows) compiles three times the graphs: slow
@pytest.mark.parametrize("dynamic", [pytest.param(False, marks=pytest.mark.slow), True])
def test_each_shape_compiles_once(dynamic):
    """Drafts of every length (the n-gram drafter's run from 0 to K, the head's stop early at its threshold), trees,
    a copy head reading the final state, transformers' output-capturing hooks on the layers, and a cache that grows
    at every step and is sized anew by every call: each pass shape (layer range, bucket, batch; the head's and its
    rows' bucket) compiles once, in one graph, and no pass recompiles after its shape's first."""
    model = make_model("qwen2", dtype=torch.float32)
    model(prompt(seed=0), output_hidden_states=True)  # installs transformers' output-capturing hooks on its layers
    selfspec.wrap(model, drafter="hybrid", exit_layer=2, max_draft_tokens=4, draft_confidence_threshold=0.3,
                  hybrid_policy="lookup-when-unsure", compile=True)
    model.selfspec.add_head(_trained_like_head(model, copy_max=2))
    compiled.step_for(model, model.device).dynamic_tokens = dynamic  # one graph per range
    try:
        counters.clear()
        for tree in (1, 2):
            model.selfspec.config = model.selfspec.config.replace(draft_tree_top_k=tree, draft_tree_size=6)
            for seed in range(1, 6):
                _plain(model, prompt(seed=seed, length=5 + 7 * seed))
                assert model.selfspec.last_stats.drafted_tokens > 0
        step = compiled.step_for(model, model.device)
        assert len(step._seen) >= 4  # draft and verify ranges at several buckets, the LM head, the exit head
        assert {"head", "rows"} <= {key[0] for key in step._seen}
        if dynamic:  # every pass, a single token's padded to two rows, shares its range's graph
            assert {key[-1] for key in step._seen} == {"T"}
        assert _graphs() == len(step._seen), "a pass recompiled, or a graph broke in two"
    finally:
        selfspec.unwrap(model)


def test_without_a_compiler_it_says_so_once_and_runs_eager(monkeypatch):
    if TEST_DEVICE != "cpu":
        pytest.skip("the C++ compiler is what a CPU needs")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    model = make_model("llama", dtype=torch.float32)
    ids = prompt(seed=21, length=9)
    plain = _plain(model, ids)
    selfspec.wrap(model, exit_layer=2, max_draft_tokens=4, compile=True)
    with pytest.warns(UserWarning, match="compile=True, but no C\\+\\+ compiler .* decoding runs eager"):
        out = _plain(model, ids)
    assert torch.equal(out, plain) and compiled.warmup_seconds(model) == 0


@pytest.mark.parametrize("t,tb,fitted", [(1, 1, 1), (3, 4, 4), (5, 8, 5), (9, 16, 9), (17, 32, 32), (33, None, None)])
def test_a_pass_runs_at_its_bucket(t, tb, fitted):
    assert compiled.bucket(t) == tb
    step = compiled.CompiledStep(torch.device("cpu"))
    step.fit(5, 9, 0, 40)  # a call's full verify passes: K + 1 = 5, a copying chain's 9
    assert compiled.bucket(t, step.buckets) == fitted


def test_padding_rows_see_their_own_slot_and_no_row_sees_past_the_real_ones():
    real = torch.ones(1, 1, 3, 7, dtype=torch.bool).tril(4)  # 3 queries entering slots 4..6
    mask = compiled.padded_mask(real, q_start=4, t=3, tb=4, length=8, dtype=torch.float32, impl="sdpa")
    assert mask.shape == (1, 1, 4, 8)
    assert torch.equal(mask[:, :, :3, :7], real) and not mask[:, :, :3, 7:].any()
    assert mask[0, 0, 3].nonzero().flatten().tolist() == [7]


@pytest.mark.slow  # every tree and batch shape compiled; the fast twin is bench's warm-up test over a chain
def test_after_the_warm_up_no_call_compiles():
    """warmup() compiles every pass shape the config makes (layer ranges at each pass size up to a tree's, the LM
    head, the exit head and its rows), for the batch sizes asked: the calls after it, of any prompt length, single
    and batched, compile nothing (Dynamo's frame counter stands still) and still decode Hugging Face's tokens."""
    model = make_model("qwen2", dtype=torch.float32)
    ids, (batch, mask) = [prompt(seed=s, length=5 + 7 * s) for s in range(1, 4)], padded_batch(seed=8)
    plain = [_plain(model, x) for x in ids] + [_plain(model, batch, mask)]
    selfspec.wrap(model, drafter="hybrid", exit_layer=2, max_draft_tokens=4, draft_confidence_threshold=0.3,
                  draft_tree_top_k=2, draft_tree_size=6, compile=True)
    model.selfspec.add_head(_trained_like_head(model, copy_max=2))
    try:
        assert model.selfspec.warmup(batch_sizes=(1, 3), progress=False) > 0
        before = _graphs()
        outs = [_plain(model, x) for x in ids] + [_plain(model, batch, mask)]
        assert all(torch.equal(a, b) for a, b in zip(outs, plain))
        assert model.selfspec.last_stats.drafted_tokens > 0
        assert _graphs() == before, "a call compiled a pass shape the warm-up missed"
    finally:
        selfspec.unwrap(model)
