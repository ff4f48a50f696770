"""Exit heads: shapes, save/load round trip, training that lowers the loss, drafts inside the draft vocabulary,
and greedy identity with every head design (random weights: verification keeps the output exact)."""
from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.heads import ExitHead, MLPHead, frequent_token_ids
from conftest import VOCAB, make_model, padded_batch, prompt

GEN = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)


def _heads(vocab_ids=None, seed=0):
    torch.manual_seed(seed)
    mlp = MLPHead(2, 32, 48, vocab_ids).double()
    torch.nn.init.normal_(mlp.down.weight, std=0.2)  # not the zero init: a head that changes the drafts
    return {"norm": ExitHead(2, vocab_ids), "mlp": mlp}


@pytest.mark.parametrize("kind", ["norm", "mlp"])
@pytest.mark.parametrize("vocab", [None, 40])
def test_shapes_and_round_trip(tmp_path, kind, vocab):
    model = make_model("llama", 4)
    vocab_ids = None if vocab is None else frequent_token_ids(torch.randint(0, VOCAB, (400,)), vocab, [2])
    head = _heads(vocab_ids)[kind]
    selfspec.wrap(model, exit_layer=2)
    out = head(torch.randn(3, 5, 32, dtype=torch.float64), model.selfspec.adapter)
    assert out.shape == (3, 5, VOCAB if vocab_ids is None else len(vocab_ids))
    model.selfspec.add_head(head)
    model.selfspec.save_pretrained(tmp_path)
    selfspec.unwrap(model)
    selfspec.wrap(model, str(tmp_path))
    loaded = model.selfspec.heads[2]
    assert type(loaded) is type(head)
    for (k, a), (k2, b) in zip(sorted(head.state_dict().items()), sorted(loaded.state_dict().items())):
        assert k == k2 and torch.equal(a, b)


@pytest.mark.parametrize("kind", ["norm", "mlp"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_greedy_identity_with_each_head(kind, family):
    model = make_model(family, 4)
    vocab_ids = frequent_token_ids(torch.randint(0, VOCAB, (400,)), 50, [2])
    ids, mask = padded_batch(seed=3)
    one = prompt(seed=3)
    ref, ref_one = model.generate(ids, attention_mask=mask, **GEN), model.generate(one, **GEN)
    for vocab in (None, vocab_ids):
        selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
        model.selfspec.add_head(_heads(vocab)[kind])
        try:
            assert torch.equal(model.generate(one, **GEN), ref_one)
            if family != "gemma2":  # HF's own padded Gemma 2 batch differs from its single rows (test_exact_greedy)
                assert torch.equal(model.generate(ids, attention_mask=mask, **GEN), ref)
        finally:
            selfspec.unwrap(model)


def test_drafts_stay_in_draft_vocabulary(monkeypatch):
    model = make_model("llama", 4)
    vocab_ids = torch.arange(3, 30)
    seen = []
    original = EarlyExitDrafter.propose

    def spy(self, state, k):
        draft = original(self, state, k)
        seen.append(draft.tokens[torch.arange(draft.k)[None, :] < draft.draft_len[:, None]])
        return draft

    monkeypatch.setattr(EarlyExitDrafter, "propose", spy)
    for sample in (False, True):
        selfspec.wrap(model, exit_layer=2, max_draft_tokens=4)
        model.selfspec.add_head(_heads(vocab_ids)["mlp"])
        model.generate(prompt(seed=5), max_new_tokens=24, do_sample=sample, pad_token_id=0)
        selfspec.unwrap(model)
    drafted = torch.cat(seen)
    assert drafted.numel() > 10 and bool(torch.isin(drafted, vocab_ids).all())


def test_training_lowers_the_loss():
    """A few distillation steps on a tiny model's own hidden states lower the KL to its output."""
    from train.train_heads import distill_loss

    model = make_model("llama", 4, agreeable=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)  # peaky output distributions, like a trained model's (random init is flat)
    selfspec.wrap(model, exit_layer=2)
    adapter = model.selfspec.adapter
    with torch.no_grad():
        out = model(torch.randint(3, VOCAB, (8, 24)), output_hidden_states=True)
    hidden = out.hidden_states[2].reshape(-1, 32)
    final = model.model.norm(out.hidden_states[-1]).reshape(-1, 32)
    top1 = out.logits.argmax(-1).reshape(-1)
    head = MLPHead(2, 32, 64).double()
    index = torch.arange(VOCAB)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = distill_loss(head, hidden, final, top1, adapter, None, index, 0.3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]
