"""The drafter contract (decoding.take_draft): drafters only propose; the loop writes their tokens, masks finished
rows and refuses hidden states from a layer other than the one it verifies from. Checked with a drafter written
and registered here, outside the package, as a user would."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import selfspec
from selfspec import SelfSpecConfig
from conftest import make_model, prompt
from selfspec.drafters import Draft, Drafter, EarlyExitDrafter, register_drafter
from selfspec.heads import ExitHead


class RepeatLastDrafter(Drafter):
    """Proposes the last token k times and never touches the state: a pure proposer."""

    name = "repeat-last"

    def propose(self, state, k):
        tokens = state.pending[:, None].repeat(1, k)
        return Draft(tokens=tokens, draft_len=torch.full_like(state.pending, k))


class CycleDrafter(Drafter):
    """Proposes tokens from a fixed cycle, some of them right for a model trained on nothing: enough accepted
    drafts that emitting the wrong tokens would show."""

    name = "cycle"

    def __init__(self, reference):
        self.reference = reference  # (T,) plain greedy continuation

    def propose(self, state, k):
        done = state.lengths[0] - state.prompt_len
        ref = self.reference[done: done + k]
        if ref.numel() == 0:
            return Draft.empty(state.batch, state.device)
        tokens = ref.clone()
        tokens[1::3] = (tokens[1::3] + 1) % 96  # every third draft wrong
        return Draft(tokens=tokens[None, :], draft_len=torch.tensor([tokens.numel()]))


def _plain(model, ids, new=20):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                          pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    return make_model("llama", 6)


def test_registered_outside_drafter_runs_by_name_and_stays_exact(model):
    register_drafter("repeat-last", lambda engine: RepeatLastDrafter())
    ids = prompt(seed=3, length=9)
    want = _plain(model, ids)
    selfspec.wrap(model, drafter="repeat-last", max_draft_tokens=3)
    try:
        got = _plain(model, ids)
        assert model.selfspec.last_stats.drafted_tokens > 0
    finally:
        selfspec.unwrap(model)
    assert torch.equal(got, want)


@dataclasses.dataclass(frozen=True)
class _StrideSettings:
    """A registered drafter's own settings record: read from the config, checked as it is made."""

    stride: int
    FIELDS = ("max_draft_tokens",)

    def __post_init__(self):
        if self.stride > 5:
            raise ValueError(f"stride drafter: max_draft_tokens must be <= 5, got {self.stride}.")

    @staticmethod
    def of(config):
        return _StrideSettings(config.max_draft_tokens)


def test_a_drafters_records_check_its_settings_and_only_its_own():
    """The registry is the one place that knows a drafter: its records check the config fields it reads when it
    is the chosen drafter, and its class says whether exit_layer must be a layer of the model."""
    from selfspec.drafters import DRAFTERS, HybridPolicy, NgramSettings

    register_drafter("stride", lambda engine: RepeatLastDrafter(), settings=(_StrideSettings,))
    try:
        SelfSpecConfig(drafter="stride", max_draft_tokens=5).validate()
        with pytest.raises(ValueError, match="stride drafter: max_draft_tokens must be <= 5, got 6"):
            SelfSpecConfig(drafter="stride", max_draft_tokens=6).validate()
        SelfSpecConfig(drafter="early_exit", exit_layer=2, max_draft_tokens=6).validate()  # not its record
    finally:
        DRAFTERS.pop("stride")
    hybrid = SelfSpecConfig(drafter="hybrid", ngram_max=4, hybrid_policy="lookup-first", hybrid_min_match=3)
    assert hybrid.drafter_settings()[1:] == (NgramSettings(4, 1), HybridPolicy("lookup-first", 3))
    with pytest.raises(ValueError, match="need integers 1 <= ngram_min <= ngram_max"):
        SelfSpecConfig(drafter="ngram", ngram_min=4).validate()
    SelfSpecConfig(drafter="early_exit", ngram_min=4, exit_layer=2).validate()  # the lookup's, not the head's
    register_drafter("deep", lambda engine: EarlyExitDrafter(engine.head_for(2)), cls=EarlyExitDrafter)
    try:
        with pytest.raises(ValueError, match="exit_layer=9 is out of range for a model with 6 decoder layers"):
            SelfSpecConfig(drafter="deep", exit_layer=9).validate(num_layers=6)
    finally:
        DRAFTERS.pop("deep")


def test_loop_writes_accepted_drafts_the_drafter_never_wrote(model):
    ids = prompt(seed=5, length=9)
    want = _plain(model, ids, new=24)
    selfspec.wrap(model, drafter=CycleDrafter(want[0, ids.shape[1]:]), max_draft_tokens=4)
    try:
        got = _plain(model, ids, new=24)
        stats = model.selfspec.last_stats
    finally:
        selfspec.unwrap(model)
    assert stats.accepted_tokens > 3  # drafts were accepted, so the emitted text came from the loop's writes
    assert torch.equal(got, want)


def test_hidden_states_from_another_layer_are_refused(model):
    head = ExitHead(2)  # a drafter exiting at layer 2 while the config verifies from layer 4
    with pytest.raises(ValueError, match="exits at layer 2, but exit_layer=4"):  # wrap refuses it at once
        selfspec.wrap(model, drafter=EarlyExitDrafter(head), exit_layer=4, max_draft_tokens=3)
    selfspec.wrap(model, drafter=EarlyExitDrafter(head), max_draft_tokens=3)
    model.selfspec.config = model.selfspec.config.replace(exit_layer=4)  # and the loop, when changed afterwards
    try:
        with pytest.raises(ValueError, match="hidden states of layer 2, but the verifier continues from layer 4"):
            _plain(model, prompt(seed=1, length=6))
    finally:
        selfspec.unwrap(model)


def test_more_drafts_than_asked_are_refused(model):
    class Greedy(Drafter):
        def propose(self, state, k):
            return Draft(tokens=state.pending[:, None].repeat(1, k + 2), draft_len=torch.full_like(state.pending, k))

    selfspec.wrap(model, drafter=Greedy(), max_draft_tokens=2)
    try:
        with pytest.raises(ValueError, match="asked for at most 2"):
            _plain(model, prompt(seed=1, length=6))
    finally:
        selfspec.unwrap(model)


def test_inputs_left_in_the_early_layers_without_their_states_are_refused(model):
    """A drafter that runs one more input through layers [0, E) than it hands over states for would make the
    verifier write the next input's KV one slot late: the loop refuses it with one line that says what to cut."""
    class RunsAheadDrafter(EarlyExitDrafter):
        def propose(self, view, k):
            draft = super().propose(view, k)
            if draft.k:  # the first draft runs through [0, E) once more, and nothing hands its state over
                view.run_early(draft.tokens[:, :1], view.pos[:, None] + draft.hidden.shape[1], 2)
            return draft

    selfspec.wrap(model, drafter=RunsAheadDrafter(ExitHead(2)), exit_layer=2, max_draft_tokens=3)
    try:
        with pytest.raises(ValueError, match=r"left \d+ inputs of this step in layers \[0, 2\) of the cache but "
                                             r"handed over hidden states for \d+"):
            _plain(model, prompt(seed=1, length=6))
    finally:
        selfspec.unwrap(model)


def test_an_early_exit_drafter_built_by_hand_takes_a_rule_or_a_bare_threshold():
    """EarlyExitDrafter(head, 0.3) is what user code wrote before ConfidenceRule: it still means a per-draft rule."""
    from selfspec.drafters import ConfidenceRule

    by_number = EarlyExitDrafter(ExitHead(2), 0.3)
    assert by_number.rule == ConfidenceRule(0.3) and by_number.threshold == 0.3
    by_rule = EarlyExitDrafter(ExitHead(2), ConfidenceRule(0.2, cumulative=True))
    assert by_rule.rule.cumulative and by_rule.threshold == 0.2


class WritesTheSequence(RepeatLastDrafter):
    """Proposes as RepeatLastDrafter does, after writing its drafts into the loop's token buffer itself."""

    name = "writes-the-sequence"

    def propose(self, view, k):
        draft = super().propose(view, k)
        cols = view.seq_len[:, None] + torch.arange(k)[None, :]
        view.seq.scatter_(1, cols, draft.tokens)
        return draft


class SetsTheLength(RepeatLastDrafter):
    name = "sets-the-length"

    def propose(self, view, k):
        view.seq_len = view.seq_len + 1
        return super().propose(view, k)


@pytest.mark.parametrize("drafter, error, message", [
    (WritesTheSequence(), RuntimeError, r"Drafter 'writes-the-sequence' wrote the loop's `seq` in place: a drafter "
                                        r"returns its tokens in a Draft"),
    (SetsTheLength(), AttributeError, r"DraftView is read-only \(tried to set 'seq_len'\)"),
])
def test_a_drafter_that_writes_the_loops_state_is_refused(model, drafter, error, message):
    selfspec.wrap(model, drafter=drafter, max_draft_tokens=3)
    try:
        with pytest.raises(error, match=message):
            _plain(model, prompt(seed=1, length=6))
    finally:
        selfspec.unwrap(model)


def test_no_drafter_module_reaches_past_its_view():
    """The modules under selfspec/drafters read the loop through DraftView only: none writes drafts into the
    sequence, holds the loop's step context (its cache and slot table) or opens the view's state."""
    import pathlib
    import re

    import selfspec.drafters

    root = pathlib.Path(selfspec.drafters.__file__).parent
    reach = re.compile(r"write_drafts|\bctx\b|\._state\b|DecodeState")
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted(root.glob("*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if reach.search(line)]
    assert not found, found


def test_every_decode_state_field_is_set_in_init(monkeypatch):
    """The loop's state is declared whole in DecodeState.__init__: decoding adds no field of its own later."""
    from selfspec import decoding

    seen = {}
    init = decoding.DecodeState.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["state"], seen["fields"] = self, set(vars(self))

    monkeypatch.setattr(decoding.DecodeState, "__init__", spy)
    for config in (dict(drafter="hybrid", exit_layer=2, max_draft_tokens=3),
                   dict(drafter="early_exit", exit_layer=2, max_draft_tokens=3, draft_tree_top_k=2,
                        draft_tree_size=4)):
        model = make_model("llama", 4)
        selfspec.wrap(model, **config)
        model.generate(prompt(seed=2, length=10), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert set(vars(seen["state"])) == seen["fields"], set(vars(seen["state"])) - seen["fields"]
