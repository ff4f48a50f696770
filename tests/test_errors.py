"""Bad input gets a clear error naming the problem and the fix."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

import selfspec
from conftest import make_model


def test_unsupported_architecture_names_supported_families():
    cfg = tf.OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32,
                       word_embed_proj_dim=16)
    with pytest.raises(ValueError, match="opt.*Llama family.*gpt2"):
        selfspec.wrap(tf.OPTForCausalLM(cfg))


def test_encoder_decoder_rejected():
    cfg = tf.T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    with pytest.raises(ValueError, match="encoder-decoder"):
        selfspec.wrap(tf.T5ForConditionalGeneration(cfg))


@pytest.mark.parametrize("exit_layer", [0, 4, -1])
def test_exit_layer_out_of_range(exit_layer):
    with pytest.raises(ValueError, match=r"exit_layer=.*1 <= exit_layer <= 3"):
        selfspec.wrap(make_model("llama", 4), exit_layer=exit_layer)


def test_max_draft_tokens_below_one():
    with pytest.raises(ValueError, match="max_draft_tokens must be an integer >= 1"):
        selfspec.wrap(make_model("llama", 4), exit_layer=1, max_draft_tokens=0)


def test_wrap_twice_and_unwrap():
    model = make_model("llama", 4)
    selfspec.wrap(model, exit_layer=2)
    with pytest.raises(ValueError, match="already wrapped.*unwrap"):
        selfspec.wrap(model, exit_layer=2)
    selfspec.unwrap(model)
    assert "generate" not in model.__dict__ and not hasattr(model, "selfspec")
    with pytest.raises(ValueError, match="not wrapped"):
        selfspec.unwrap(model)


def test_wrap_leaves_module_tree_alone():
    model = make_model("llama", 4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    selfspec.wrap(model, exit_layer=2)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_flash_attention_rejected_with_fix():
    model = make_model("llama", 4)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        selfspec.wrap(model)


def test_unknown_config_field():
    with pytest.raises(TypeError, match="Unknown selfspec option.*exit_layr.*exit_layer"):
        selfspec.wrap(make_model("llama", 4), exit_layr=2)


def test_switches_must_be_bools():
    """A YAML or JSON "yes"/"no" string would otherwise read as true."""
    with pytest.raises(ValueError, match="draft_confidence_cumulative must be true or false, got 'no'"):
        selfspec.wrap(make_model("llama", 4), exit_layer=1, drafter="hybrid", draft_confidence_cumulative="no")


def test_hybrid_policy_is_one_of_the_named_ones():
    with pytest.raises(ValueError, match=r"hybrid_policy must be one of \['lookup-first', .*got 'head-first'"):
        selfspec.wrap(make_model("llama", 4), exit_layer=1, drafter="hybrid", hybrid_policy="head-first")


def test_the_hybrids_former_flags_name_the_policy_that_replaced_them():
    with pytest.raises(ValueError, match=r"\['hybrid_extend'\] are one named policy now: set hybrid_policy to"):
        selfspec.SelfSpecConfig.from_dict({"drafter": "hybrid", "hybrid_extend": True})


@pytest.mark.parametrize("bad", [-1, 17, "5", True, 2.0])
def test_copy_max_must_be_a_small_integer(bad):
    from selfspec.heads import MLPHead

    with pytest.raises(ValueError, match=r"copy_max must be an integer in \[0, 16\]"):
        MLPHead(2, 32, 48, copy_max=bad)


def test_train_copy_refuses_heads_that_are_not_mlp():
    from selfspec.heads import AttentionHead
    from selfspec.training.train_copy import copy_head_from, parse_args

    model = make_model("llama", 4)
    head = AttentionHead.from_model(selfspec.arch.adapter_for(model), 2)
    with pytest.raises(SystemExit, match="train.train_copy extends MLP and fused heads; the head at layer 2 is 'attn'"):
        copy_head_from(head, 3)
    with pytest.raises(SystemExit, match="--copy-max 0: must be in"):
        parse_args(["--copy-max", "0"])
