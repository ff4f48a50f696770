"""The n-gram, draft-model and hybrid drafters: the lookup itself, greedy identity with the unwrapped model
(single rows and padded batches, several K), sampling exactness against the exact marginals of the target with a
negative control, and the draft model's vocabulary check."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from transformers.generation import logits_process as lp

import selfspec
import selfspec.decoding
from conftest import TEST_DEVICE, make_model
from distribution import accept_everything, chi_square_pvalue, exact_marginals
from selfspec.drafters import build_drafter
from selfspec.lookup import suffix_match

GEN = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
LAYERS = 4


# --- the lookup on hand-made sequences --------------------------------------------------------------------------

def _match(row, n_max=3, n_min=1):
    text = torch.tensor([row])
    match, end = suffix_match(text, torch.tensor([len(row) - 1]), n_max, n_min)
    return int(match), int(end)


def test_suffix_match_longest_then_most_recent():
    assert _match([5, 6, 7, 9, 6, 7, 8, 6, 7]) == (2, 5)  # "6 7" twice: the later one, ending at index 5
    assert _match([1, 6, 7, 2, 6, 7, 3, 9, 7]) == (1, 5)  # only "7" recurs: its most recent occurrence
    assert _match([1, 2, 3, 4]) == (0, 0)  # nothing recurs
    assert _match([4, 4, 4, 4], n_max=3) == (3, 2)  # overlapping occurrences count
    assert _match([1, 6, 2, 3, 6], n_max=3, n_min=2) == (0, 0)  # a 1-gram match is below n_min
    assert _match([5, 5], n_max=5) == (1, 0)  # a text shorter than n_max (a one-token prompt, one token out)


@pytest.mark.parametrize("name", ["ngram", "hybrid"])
def test_a_one_token_prompt_with_long_ngrams(name):
    """The first steps of a one-token prompt look back further than the text reaches."""
    model = make_model("llama", LAYERS)
    ids = torch.tensor([[7]])
    ref = model.generate(ids, **GEN)
    out, _, _ = _speculative(model, ids, None, name, exit_layer=2, max_draft_tokens=4, ngram_max=5)
    assert torch.equal(out, ref)


def test_suffix_match_ignores_padding():
    pad = -1  # what NgramDrafter puts where the prompt is padded
    text = torch.tensor([[pad, pad, 4, 5, 4], [7, 4, 5, 9, 4]])
    match, end = suffix_match(text, torch.tensor([4, 4]), 3, 1)
    assert match.tolist() == [1, 1] and end.tolist() == [2, 1]


def _lookup(seq, prompt_len, mask=None, k=3, eos=(2,), finished=None):
    """NgramDrafter.lookup on a stand-in state holding just what it reads."""
    from types import SimpleNamespace

    from selfspec.drafters.ngram import NgramDrafter

    seq = torch.tensor(seq)
    eos_t = torch.tensor(eos)
    state = SimpleNamespace(
        seq=seq, seq_len=torch.full((seq.shape[0],), seq.shape[1]), lengths=[seq.shape[1]] * seq.shape[0],
        mask=mask, prompt_len=prompt_len,
        finished=torch.zeros(seq.shape[0], dtype=torch.bool) if finished is None else torch.tensor(finished),
        is_eos=lambda t: torch.isin(t, eos_t))
    drafter = NgramDrafter(3, 1)
    drafter.begin(state, None)
    return drafter.lookup(state, k)


def test_lookup_continuation_eos_and_finished_rows():
    found = _lookup([[9, 3, 4, 5, 6, 3, 4], [9, 3, 4, 2, 8, 3, 4]], prompt_len=7, finished=[False, False])
    assert found.match.tolist() == [2, 2]
    assert found.tokens[0].tolist() == [5, 6, 3] and found.length[0] == 3
    assert found.tokens[1, :2].tolist() == [2, 8] and found.length[1] == 1  # nothing drafted past EOS (2)
    done = _lookup([[9, 3, 4, 5, 6, 3, 4]], prompt_len=7, finished=[True])
    assert done.length.tolist() == [0]


def test_lookup_never_matches_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    found = _lookup([[0, 0, 7, 8, 0]], prompt_len=5, mask=mask)  # the final 0 is a real token, the first two pad
    assert found.length.tolist() == [0]
    assert not bool((found.tokens < 0).any())  # unused columns hold real tokens, they still go to the verifier


# --- greedy identity ------------------------------------------------------------------------------------------

def _repetitive_prompt(seed=0, period=5, length=14, vocab=96):
    g = torch.Generator().manual_seed(seed)
    unit = torch.randint(3, vocab, (period,), generator=g, device="cpu")
    return unit.repeat(length // period + 1)[:length][None, :].to(TEST_DEVICE)


def _repetitive_batch(seed=0, lengths=(14, 6, 11)):
    """Left-padded (3, T) batch: rows repeat a short random unit (rows 0 and 2) or not (row 1)."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        period = 4 + row if row != 1 else n
        ids[row, width - n:] = _repetitive_prompt(seed + row, period, n)[0]
        mask[row, width - n:] = 1
    return ids, mask


def _truncated_copy(model, layers):
    """A separate draft model: the target's first `layers` layers, embeddings and LM head (its own weights)."""
    draft = copy.deepcopy(model)
    base = draft.transformer if hasattr(draft, "transformer") else draft.model
    name = "h" if hasattr(base, "h") else "layers"
    setattr(base, name, getattr(base, name)[:layers])
    draft.config.num_hidden_layers = layers
    if hasattr(draft.config, "n_layer"):
        draft.config.n_layer = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft


def _speculative(model, ids, mask, drafter, **cfg):
    """Generate with `drafter` ("ngram", "hybrid" or a draft model); returns (output, stats, drafter used)."""
    selfspec.wrap(model, drafter=drafter, **cfg)
    try:
        engine = model.selfspec
        used = engine.drafter_override = build_drafter(engine)
        out = model.generate(ids, attention_mask=mask, **GEN)
        return out, engine.last_stats, used
    finally:
        selfspec.unwrap(model)


def _drafter_for(name, model):
    return _truncated_copy(model, 2) if name == "model" else name


@pytest.mark.parametrize("name", ["ngram", "hybrid", "model"])
def test_greedy_identity_single_row(name):
    model = make_model("llama", LAYERS)
    ids = _repetitive_prompt(seed=2)
    ref = model.generate(ids, **GEN)
    drafter = _drafter_for(name, model)
    accepted = 0
    for k in (1, 3, 6):
        out, stats, _ = _speculative(model, ids, None, drafter, exit_layer=2, max_draft_tokens=k)
        assert torch.equal(out, ref), (name, k)
        assert stats.new_tokens == ref.shape[1] - ids.shape[1]
        accepted += stats.accepted_tokens
    assert accepted > 0  # drafts were actually accepted, not just rejected


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "gemma2"])
@pytest.mark.parametrize("name", ["ngram", "hybrid", "model"])
def test_greedy_identity_padded_batch(family, name):
    model = make_model(family, LAYERS)
    ids, mask = _repetitive_batch(seed=2)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    if family == "gemma2":  # HF's padded Gemma 2 batch differs from its single rows; compare per row
        ref = _per_row(model, ids, mask)
    drafter = _drafter_for(name, model)
    accepted = 0
    for k in (2, 5):
        out, stats, _ = _speculative(model, ids, mask, drafter, exit_layer=2, max_draft_tokens=k)
        assert torch.equal(out if family != "gemma2" else _right_pad(out, ids.shape[1]), ref), (family, name, k)
        accepted += stats.accepted_tokens
    assert accepted > 0


def _right_pad(out, prompt_len):
    new = out[:, prompt_len:]
    return torch.nn.functional.pad(new, (0, GEN["max_new_tokens"] - new.shape[1]), value=GEN["pad_token_id"])


def _per_row(model, ids, mask):
    rows = [ids[r: r + 1, mask[r].bool()] for r in range(ids.shape[0])]
    return torch.stack([_right_pad(model.generate(row, **GEN), row.shape[1])[0] for row in rows])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_draft_model_copy_of_target_accepts_everything(family):
    """A draft model equal to the target proposes exactly the target's tokens only if its own cache holds exactly
    the verified prefix every step (catch-up, rollback, holes of a padded batch): acceptance must be 100%."""
    model = make_model(family, LAYERS)
    ids, mask = _repetitive_batch(seed=2)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    for k in (1, 3, 6):
        out, stats, _ = _speculative(model, ids, mask, copy.deepcopy(model), exit_layer=2, max_draft_tokens=k)
        assert torch.equal(out, ref), k
        assert stats.acceptance_rate == 1.0, (k, stats)
        assert stats.mean_accepted_tokens > min(k + 1, 3) - 0.5, (k, stats)


def test_draft_model_of_another_family():
    """Any causal LM with the same vocabulary drafts: a GPT-2 (absolute positions) for a Qwen2 target."""
    target = make_model("qwen2", LAYERS)
    draft = make_model("gpt2", 2, seed=5)
    ids, mask = _repetitive_batch(seed=3)
    ref = target.generate(ids, attention_mask=mask, **GEN)
    for k in (2, 5):
        out, _, _ = _speculative(target, ids, mask, draft, exit_layer=2, max_draft_tokens=k)
        assert torch.equal(out, ref), k


def test_draft_model_with_eos_and_max_length():
    """Rows stop at EOS at different steps; the draft model's cache keeps up with the survivors."""
    model = make_model("llama", LAYERS, seed=7)
    ids, mask = _repetitive_batch(seed=6)
    plain = model.generate(ids, attention_mask=mask, **GEN)
    kw = dict(GEN, eos_token_id=[int(plain[0, -12]), int(plain[2, -6])])
    ref = model.generate(ids, attention_mask=mask, **kw)
    for drafter in (_truncated_copy(model, 2), "ngram", "hybrid"):
        selfspec.wrap(model, drafter=drafter, exit_layer=2, max_draft_tokens=4)
        try:
            assert torch.equal(model.generate(ids, attention_mask=mask, **kw), ref), drafter
        finally:
            selfspec.unwrap(model)


def test_hybrid_takes_every_path():
    """Across one padded batch the hybrid drafts whole steps by n-gram, whole steps by early exit, and mixed steps
    where n-gram rows are teacher-forced through the early-exit pass; the output stays identical."""
    model = make_model("llama", LAYERS)
    ids, mask = _repetitive_batch(seed=2)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    steps = {}
    for extend in (True, False):
        for k in (2, 6):
            out, _, used = _speculative(model, ids, mask, "hybrid", exit_layer=2, max_draft_tokens=k,
                                        hybrid_policy="lookup-then-head" if extend else "lookup-first",
                                        hybrid_min_match=2)
            assert torch.equal(out, ref), (extend, k)
            for path, count in used.steps.items():
                steps[path] = steps.get(path, 0) + count
    assert all(steps.get(p, 0) > 0 for p in ("ngram", "early_exit", "mixed")), steps


@pytest.mark.parametrize("extend, k", [(False, 4), (True, 2)])  # extending: a short draft, so matches fill it
def test_hybrid_trees_skip_the_head_where_every_row_matches(extend, k):
    """By the chain's rule, a hybrid tree step in which no row needs the head (every live row has a strong match,
    and with `extend` one that fills the draft or ends in an EOS) drafts n-gram branches only: the head's layers
    run in no such step, other steps grow the head's tree, and the padded batch's output stays identical."""
    model = make_model("llama", LAYERS)
    ids, mask = _repetitive_batch(seed=2, lengths=(14, 12, 11))  # every row repeats: matches at most steps
    ref = model.generate(ids, attention_mask=mask, **GEN)
    selfspec.wrap(model, drafter="hybrid", exit_layer=2, max_draft_tokens=k, draft_tree_top_k=2,
                  draft_tree_size=8, hybrid_policy="lookup-then-head" if extend else "lookup-first",
                  hybrid_min_match=2)
    try:
        engine = model.selfspec
        used = engine.drafter_override = build_drafter(engine)
        ran, propose, run = [], used.propose, used.early.run
        used.early.run = lambda *a, **k: (ran.append(1), run(*a, **k))[1]

        def counted(state, k):  # head passes per step, keyed by the path the step took
            before, paths = len(ran), dict(used.steps)
            draft = propose(state, k)
            path = next((p for p in used.steps if used.steps[p] != paths.get(p, 0)), "none")  # k = 0: none
            passes.setdefault(path, []).append(len(ran) - before)
            return draft

        passes = {}
        used.propose = counted
        assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)
    finally:
        selfspec.unwrap(model)
    assert passes.get("ngram") and set(passes["ngram"]) == {0}, passes
    assert any(n > 0 for path, runs in passes.items() if path != "ngram" for n in runs), passes


def test_hybrid_trees_graft_branches_onto_the_heads_tree():
    """Where the head's tree holds an n-gram branch's first tokens, the branch continues below the head's nodes
    instead of hanging under the root as a second child of the same token, which verification would never reach
    (greedy takes the first of equal siblings, and sampling removes the token from the residual): no proposed node
    has a sibling of its own token, and the output stays identical. (Hung under the root, the branches give such
    siblings here: the untrained head's top 4 of a 96-token vocabulary often hold the lookup's token.)"""
    model = make_model("llama", LAYERS)
    ids, mask = _repetitive_batch(seed=2, lengths=(14, 12, 11))
    ref = model.generate(ids, attention_mask=mask, **GEN)
    selfspec.wrap(model, drafter="hybrid", exit_layer=2, max_draft_tokens=4, draft_tree_top_k=4,
                  draft_tree_size=16, hybrid_policy="lookup-then-head", hybrid_min_match=1)
    try:
        engine = model.selfspec
        used = engine.drafter_override = build_drafter(engine)
        drafts, propose = [], used.propose
        used.propose = lambda state, k: (drafts.append(propose(state, k)), drafts[-1])[1]
        assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)
    finally:
        selfspec.unwrap(model)
    trees = [(t[:n], p[:n]) for d in drafts if d.parents is not None
             for t, p, n in zip(d.tokens.tolist(), d.parents.tolist(), d.draft_len.tolist())]
    assert trees and all(len(set(zip(p, t))) == len(t) for t, p in trees), "a node has two children of one token"


@pytest.mark.parametrize("top_k", [1, 2])  # chains, then trees (whose head grows no node below 0.99 either)
def test_hybrid_fallback_drafts_short_matches_the_head_declines(top_k):
    """No match is long enough to trust (min_match above ngram_max) and the head is never sure enough (threshold
    0.99): without fallback the hybrid drafts nothing; with it each row drafts its short match's continuation (in a
    tree, its branches), some of it accepted, and the padded batch's output stays identical."""
    model = make_model("llama", LAYERS)
    ids, mask = _repetitive_batch(seed=2)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    drafted = {}
    for fallback in (False, True):
        out, stats, _ = _speculative(model, ids, mask, "hybrid", exit_layer=2, max_draft_tokens=4, ngram_max=2,
                                     hybrid_min_match=3, draft_confidence_threshold=0.99,
                                     hybrid_policy="lookup-when-unsure" if fallback else "lookup-then-head",
                                     draft_tree_top_k=top_k, draft_tree_size=8)
        assert torch.equal(out, ref), fallback
        drafted[fallback] = (stats.drafted_tokens, stats.accepted_tokens)
    assert drafted[False] == (0, 0) and drafted[True][1] > 0, drafted


def test_hybrid_rematch_drafts_a_copy_the_head_starts_by_lookup():
    """With lookup-when-copying, a chain row whose head drafts bring its text to end in a strong match drafts the rest
    of that match's continuation by lookup: fewer head passes for no fewer accepted tokens a step on repeating text,
    and the padded batch's output stays identical."""
    model = make_model("llama", LAYERS)
    ids, mask = _repetitive_batch(seed=2)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    seen = {}
    for rematch in (False, True):
        selfspec.wrap(model, drafter="hybrid", exit_layer=2, max_draft_tokens=6, ngram_max=4, hybrid_min_match=4,
                      hybrid_policy="lookup-when-copying" if rematch else "lookup-when-unsure")
        try:
            engine = model.selfspec
            used = engine.drafter_override = build_drafter(engine)
            passes, run = [], used.early.run
            used.early.run = lambda *a, **k: (passes.append(1), run(*a, **k))[1]
            assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref), rematch
            stats = engine.last_stats
            seen[rematch] = (len(passes), stats.new_tokens / stats.verify_steps, used.steps["rematched"])
        finally:
            selfspec.unwrap(model)
    assert seen[False][2] == 0 and seen[True][2] > 0, seen
    assert seen[True][0] < seen[False][0] and seen[True][1] >= seen[False][1], seen


@pytest.mark.parametrize("drafter", ["early_exit", "hybrid"])
def test_cumulative_confidence_drafts_less_and_stays_identical(drafter):
    """draft_confidence_cumulative judges a chain's next draft by the product of the top probabilities so far,
    which only falls: at the same threshold it drafts fewer tokens than judging each draft alone (so the knob
    reaches the drafter), and the padded batch's greedy output stays identical either way."""
    model = make_model("llama", LAYERS)
    ids, mask = _repetitive_batch(seed=1)
    ref = model.generate(ids, attention_mask=mask, **GEN)
    drafted = {}
    for cumulative in (False, True):
        out, stats, _ = _speculative(model, ids, mask, drafter, exit_layer=2, max_draft_tokens=6,
                                     draft_confidence_threshold=0.012, draft_confidence_cumulative=cumulative,
                                     hybrid_min_match=3, ngram_max=2)
        assert torch.equal(out, ref), cumulative
        drafted[cumulative] = stats.drafted_tokens
    assert 0 < drafted[True] < drafted[False], drafted


# --- errors ---------------------------------------------------------------------------------------------------

def test_draft_model_vocabulary_mismatch_is_named():
    model = make_model("llama", LAYERS)
    other = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2)).double()
    selfspec.wrap(model, drafter=other, exit_layer=2)
    try:
        with pytest.raises(ValueError, match="vocabulary.*LM head rows differ: target 96, draft 50"):
            model.generate(_repetitive_prompt(), **GEN)
    finally:
        selfspec.unwrap(model)


def test_model_drafter_without_a_model_says_how():
    model = make_model("llama", LAYERS)
    selfspec.wrap(model, drafter="model", exit_layer=2)
    try:
        with pytest.raises(ValueError, match="needs a draft model"):
            model.generate(_repetitive_prompt(), **GEN)
    finally:
        selfspec.unwrap(model)


# --- sampling exactness ---------------------------------------------------------------------------------------

VOCAB, ROWS, STEPS = 10, 6000, 4  # 4 tokens: after the first, drafts of depth 2 (a tree of two levels)
ALPHA = 1e-4
SAMPLE = dict(do_sample=True, temperature=0.9, top_k=8, max_new_tokens=STEPS, pad_token_id=0)
PROCESSORS = lp.LogitsProcessorList([lp.TemperatureLogitsWarper(0.9), lp.TopKLogitsWarper(8)])
PROMPT = torch.tensor([[3, 7, 5, 3, 7, 6, 3, 7]])  # repeats, so that n-gram drafts are made; "3 7" is followed by
# two different tokens, so that an n-gram tree has two branches


def _tiny(seed, layers=3):
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    model = tf.LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():  # sharper than uniform, so that distributions differ detectably
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def target_and_exact():
    model = _tiny(11)
    return model, exact_marginals(model, PROMPT, STEPS, PROCESSORS)


SAMPLING_CASES = {
    "ngram": dict(drafter="ngram", exit_layer=1, max_draft_tokens=2),
    "hybrid": dict(drafter="hybrid", exit_layer=1, max_draft_tokens=2, hybrid_min_match=2),
    # every match is short (min_match above ngram_max): rows draft with the head when it is sure, else their match
    "hybrid-fallback": dict(drafter="hybrid", exit_layer=1, max_draft_tokens=2, ngram_max=2, hybrid_min_match=3,
                            draft_confidence_threshold=0.5, hybrid_policy="lookup-when-unsure"),
    # the head's drafts bring a strong match: its continuation drafted by lookup (point masses) after the head's q
    "hybrid-rematch": dict(drafter="hybrid", exit_layer=1, max_draft_tokens=3, ngram_max=2, hybrid_min_match=2,
                           hybrid_policy="lookup-when-copying"),
    "model": dict(exit_layer=1, max_draft_tokens=2),  # drafter: a separate random model
    # a draft tree: two levels, up to three children per node, checked by multi-candidate rejection
    "tree": dict(drafter="early_exit", exit_layer=1, max_draft_tokens=2, draft_tree_top_k=3, draft_tree_size=6),
    "ngram-tree": dict(drafter="ngram", exit_layer=1, max_draft_tokens=2, draft_tree_top_k=3, draft_tree_size=6),
    "hybrid-tree": dict(drafter="hybrid", exit_layer=1, max_draft_tokens=2, hybrid_min_match=1, draft_tree_top_k=2,
                        draft_tree_size=6),
    # the same short matches as hybrid-fallback, as branches grafted onto the head's tree
    "hybrid-fallback-tree": dict(drafter="hybrid", exit_layer=1, max_draft_tokens=2, ngram_max=2, hybrid_min_match=3,
                                 draft_confidence_threshold=0.5, hybrid_policy="lookup-when-unsure",
                                 draft_tree_top_k=2,
                                 draft_tree_size=6),
    # a head that reads the previous position's final state (its own estimate after the first draft)
    "top-head": dict(drafter="early_exit", exit_layer=1, max_draft_tokens=2, head="mlp-top"),
    "top-head-tree": dict(drafter="early_exit", exit_layer=1, max_draft_tokens=2, draft_tree_top_k=3,
                          draft_tree_size=6, head="mlp-top"),
    # a copy head: prompt lookup's candidate, trusted by match length, moves the draft distribution q
    "copy-head": dict(drafter="early_exit", exit_layer=1, max_draft_tokens=2, head="mlp-copy"),
    "copy-head-tree": dict(drafter="early_exit", exit_layer=1, max_draft_tokens=2, draft_tree_top_k=3,
                           draft_tree_size=6, head="mlp-copy"),
    # a copy head's chain that runs past K=1 while it copies (draft_length.copy_budget): whether a draft is
    # proposed there must not depend on the sampled token's own value
    "copy-head-run": dict(drafter="early_exit", exit_layer=1, max_draft_tokens=1, copy_draft_tokens=2,
                          head="mlp-copy"),
    # the hybrid's runs past K=1: a lookup's copy (a match of 2+ tokens) at the step's start and after a head draft
    "hybrid-run": dict(drafter="hybrid", exit_layer=1, max_draft_tokens=1, copy_draft_tokens=3, ngram_max=2,
                       hybrid_min_match=2, hybrid_policy="lookup-when-copying"),
}


def _top_head(hidden_size: int, dtype):
    """A top-reading MLP head at layer 1, near the plain exit but depending on the state it reads."""
    from selfspec.heads import MLPHead

    torch.manual_seed(7)
    head = MLPHead(1, hidden_size, 2 * hidden_size, context="top").to(dtype)
    for w in (head.down.weight, head.top_in.weight):
        torch.nn.init.normal_(w, std=0.02)
    return head


def _copy_head(hidden_size: int, dtype):
    """The top-reading head above, also a copy head that trusts longer matches more."""
    from selfspec.heads import MLPHead

    head = MLPHead(1, hidden_size, 2 * hidden_size, context="top", copy_max=2)
    head.load_state_dict(_top_head(hidden_size, torch.float32).state_dict(), strict=False)
    with torch.no_grad():
        head.copy_bias.copy_(torch.tensor([0.0, 1.0, 2.5]))
    return head.to(dtype)


HEADS = {"mlp-top": _top_head, "mlp-copy": _copy_head}


def _sampled_pvalues(target_and_exact, case):
    model, exact = target_and_exact
    cfg = dict(SAMPLING_CASES[case])
    cfg.setdefault("drafter", _tiny(23, layers=1))
    head = cfg.pop("head", None)
    selfspec.wrap(model, **cfg)
    if head:
        model.selfspec.add_head(HEADS[head](model.config.hidden_size, model.dtype))
    try:
        torch.manual_seed(1234)
        out = model.generate(PROMPT.repeat(ROWS, 1), **SAMPLE)[:, PROMPT.shape[1]:]
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    return [chi_square_pvalue(out[:, t], exact[t]) for t in range(STEPS)], stats


@pytest.mark.parametrize("case", sorted(SAMPLING_CASES))
def test_sampling_matches_target(target_and_exact, case):
    pvalues, stats = _sampled_pvalues(target_and_exact, case)
    assert 0.05 < stats.acceptance_rate < 0.95, stats  # accept and resample paths are both exercised
    if SAMPLING_CASES[case].get("copy_draft_tokens"):  # some chains ran past K
        assert stats.drafted_tokens > (stats.verify_steps - ROWS) * SAMPLING_CASES[case]["max_draft_tokens"], stats
    assert stats.drafted_tokens > ROWS // 5, stats  # a fair share of rows drafted (n-gram: those with a match)
    assert min(pvalues) > ALPHA, pvalues


@pytest.mark.parametrize("case", sorted(c for c in SAMPLING_CASES if not c.endswith("tree")))
def test_sampling_negative_control_fails(target_and_exact, case, monkeypatch):
    monkeypatch.setattr(selfspec.decoding, "choose", accept_everything)
    pvalues, _ = _sampled_pvalues(target_and_exact, case)
    assert min(pvalues[1:]) < ALPHA, pvalues  # the drafted positions are off


@pytest.mark.parametrize("case", sorted(c for c in SAMPLING_CASES if c.endswith("tree")))
def test_tree_sampling_negative_control_residual(target_and_exact, monkeypatch, case):
    """Planted bug in multi-candidate rejection: a rejected child stays in the residual that its later siblings
    are tested against and the verifier's token is drawn from, so drafted tokens come out too often."""
    import selfspec.trees

    monkeypatch.setattr(selfspec.trees, "residual_after_rejection", lambda r, x, q: r)
    pvalues, _ = _sampled_pvalues(target_and_exact, case)
    assert min(pvalues) < ALPHA, pvalues


def _lookup_rule(rows: torch.Tensor, last: torch.Tensor, n_max: int) -> tuple[list[int], list[int]]:
    """The n-gram drafter's vectorised rule on (R, L) texts ending at `last` (R,): each row's copy candidate
    (-1: none) and match length."""
    from selfspec.lookup import continuation, suffix_match

    match, end = suffix_match(rows, last, n_max, 1)
    token, length = continuation(rows, last, match, end, 1)
    match = match.masked_fill(length == 0, 0)
    return torch.where(match > 0, token[:, 0], -1).tolist(), match.tolist()


@pytest.mark.usefixtures("on_cpu")
def test_prefix_copy_candidates_match_the_drafters_lookup():
    """train_copy and eval_heads look candidates up for every prefix in one pass; the n-gram drafter with
    suffix_match on the text so far. Both must give the same token and match length at every position."""
    from selfspec.lookup import prefix_copy_candidates

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        length, n_max = int(torch.randint(1, 40, (1,), generator=g)), 1 + trial % 5
        text = torch.randint(0, 2 + trial % 5, (length,), generator=g)
        last = torch.arange(length)
        rows = text[None].expand(length, length).masked_fill(torch.arange(length)[None] > last[:, None], -1)
        assert prefix_copy_candidates(text.tolist(), n_max) == _lookup_rule(rows, last, n_max), trial


@pytest.mark.usefixtures("on_cpu")
def test_copy_paths_look_up_each_inputs_path_as_the_vectorised_rule():
    """The copy head's host index (CopyPaths) against the n-gram drafter's rule on the whole text: a padded batch,
    a chain step and then a tree step whose nodes read their ancestors' drafts, with text verified in between."""
    from types import SimpleNamespace

    from selfspec.head_state import CopyPaths
    from selfspec.lookup import PAD

    g = torch.Generator().manual_seed(1)
    for trial in range(30):
        b, prompt_len, n_max, vocab = 3, 12, 1 + trial % 4, 2 + trial % 4
        seq = torch.randint(0, vocab, (b, 40), generator=g)
        mask = torch.ones(b, prompt_len, dtype=torch.long)
        mask[1, :3] = 0  # left padding, and a gap: padding never matches
        mask[2, 5] = 0
        state = SimpleNamespace(seq=seq, prompt_len=prompt_len, mask=mask, batch=b, lengths=[prompt_len] * b)
        paths = CopyPaths(n_max)
        paths.begin(state)
        text = seq.masked_fill(torch.nn.functional.pad(mask == 0, (0, 40 - prompt_len)), PAD)
        for verified, parents in ((prompt_len, None), (prompt_len + 4, torch.tensor([[0, 0, 1, 2, 1]] * b))):
            state.lengths = [verified] * b
            paths.start()
            inputs = torch.randint(0, vocab, (b, 1 if parents is None else 5), generator=g)
            inputs[:, 0] = seq[:, verified - 1]  # the step's first input is the pending token
            chain = torch.randint(0, vocab, (b, 3), generator=g)
            calls = [(inputs, parents)] if parents is not None else [(inputs, None), (chain, None)]
            got = [paths.candidates(state, x, p) for x, p in calls]
            order = torch.cat([x for x, _ in calls], dim=1)  # every input of the step, in verify-input order
            parent = (torch.arange(order.shape[1]) - 1)[None].expand(b, -1) if parents is None else parents
            for row in range(b):
                for i in range(order.shape[1]):
                    path, cur = [], i
                    while cur > 0:  # the drafts on input i's path, newest first
                        path.append(int(order[row, cur]))
                        cur = int(parent[row, cur])
                    whole = torch.cat([text[row, :verified], torch.tensor(path[::-1], dtype=torch.long)])
                    want = _lookup_rule(whole[None], torch.tensor([len(whole) - 1]), n_max)
                    have = torch.cat([t for t, _ in got], 1)[row, i], torch.cat([m for _, m in got], 1)[row, i]
                    assert (int(have[0]), int(have[1])) == (want[0][0], want[1][0]), (trial, row, i)


