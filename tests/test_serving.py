"""selfspec's drafters for vLLM: the export (`selfspec export-vllm`), the exported head rebuilt as the draft model
rebuilds it against the trained one, the custom_class prompt lookup against a direct reading of its rule, and, where a vLLM environment is
given (SELFSPEC_VLLM_PYTHON), vLLM itself serving with both drafters against vLLM without speculation."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

import selfspec
from conftest import make_model
from selfspec.heads import FusedHead, MLPHead
from selfspec.serving.export import export_vllm, write_draft
from selfspec.serving.vllm_draft import ARCHITECTURE
from selfspec.serving.vllm_ngram import propose_rows

HIDDEN = 32


def _wrapped(tmp_path, family="llama", exit_layer=2, context="top", vocab=(3, 5, 8, 13, 21, 34, 55, 89)):
    model = make_model(family, layers=4, dtype=torch.float32)
    model.save_pretrained(tmp_path / "target")
    selfspec.wrap(model, exit_layer=exit_layer, max_draft_tokens=3)
    torch.manual_seed(3)
    head = MLPHead(exit_layer, HIDDEN, 2 * HIDDEN, vocab_ids=torch.tensor(vocab), context=context)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.1)
    model.selfspec.add_head(head)
    return model, head


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_export_holds_the_first_layers_the_head_and_its_vocabulary_rows(tmp_path, family):
    model, head = _wrapped(tmp_path, family)
    result = write_draft(model, tmp_path / "draft", target=str(tmp_path / "target"))
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["num_hidden_layers"] == 2
    assert AutoConfig.from_pretrained(tmp_path / "draft").num_hidden_layers == 2  # a config vLLM's loader accepts
    assert config["selfspec_family"] == family
    assert config["selfspec_head"] == {**head.spec(), "draft_vocab_size": 8, "copy_max": 0}
    assert result.exit_layer == 2 and result.num_speculative_tokens == 3
    assert result.speculative_config()["method"] == "eagle"
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    state = model.state_dict()
    layers = {name for name in tensors if name.startswith("model.layers.")}
    assert layers == {name for name in state if name.startswith(("model.layers.0.", "model.layers.1."))}
    for name in layers | {"model.norm.weight"}:
        torch.testing.assert_close(tensors[name], state[name], rtol=0, atol=0)
    assert "model.embed_tokens.weight" not in tensors  # vLLM shares the target's
    torch.testing.assert_close(tensors["lm_rows"], model.lm_head.weight[head.vocab_ids], rtol=0, atol=0)
    assert tensors["vocab_ids"].tolist() == head.vocab_ids.tolist()


def test_the_exported_head_rebuilt_computes_what_the_trained_one_does(tmp_path):
    """The draft model builds selfspec's MLPHead from the exported spec and loads the exported weights into it (every
    one of them, strictly); fed the same layer-E and previous final states, it gives the trained head's residual
    stream."""
    model, head = _wrapped(tmp_path)
    write_draft(model, tmp_path / "draft", target=str(tmp_path / "target"))
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    spec = json.loads((tmp_path / "draft" / "config.json").read_text())["selfspec_head"]
    draft = MLPHead(spec["exit_layer"], HIDDEN, spec["rank"], context=spec["context"])
    draft.load_state_dict({name.removeprefix("head."): t for name, t in tensors.items() if name.startswith("head.")})
    hidden, prev_top = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    torch.testing.assert_close(draft.transform(hidden, None, prev_top), head.transform(hidden, None, prev_top))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_fused_head_exports_its_layer_and_mix_beside_its_fusion(tmp_path, family):
    """A fused head's draft directory holds its MLP under the names an `mlp` head's export uses, its decoder layer
    (HF names, which vLLM's mapper fuses) and `mix`; the config names it and gives its layer the per-layer settings
    of the layer it was copied from."""
    model, mlp = _wrapped(tmp_path, family)
    head = FusedHead.from_mlp(mlp, model.selfspec.adapter, source_layer=3)
    torch.nn.init.normal_(head.mix, std=0.1)
    model.selfspec.add_head(head)
    model.config.layer_types = ["full_attention"] * 3 + ["sliding_attention"]
    write_draft(model, tmp_path / "draft", target=str(tmp_path / "target"))
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["selfspec_head"] == {**head.spec(), "draft_vocab_size": 8, "copy_max": 0}
    assert config["layer_types"] == ["full_attention", "full_attention", "sliding_attention"]
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    torch.testing.assert_close(tensors["head_mix"], head.mix, rtol=0, atol=0)
    layer = {name.removeprefix("model.head_layer."): t for name, t in tensors.items()
             if name.startswith("model.head_layer.")}
    assert layer.keys() == head.layer.state_dict().keys()
    for name, t in head.layer.state_dict().items():
        torch.testing.assert_close(layer[name], t, rtol=0, atol=0)
    draft = MLPHead(head.exit_layer, HIDDEN, head.rank, context="top")
    draft.load_state_dict({name.removeprefix("head."): t for name, t in tensors.items() if name.startswith("head.")})
    hidden, prev_top = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN)
    torch.testing.assert_close(draft.transform(hidden, None, prev_top), head.fused(hidden, None, prev_top))


def test_the_export_command_writes_the_shipped_heads_draft_and_how_to_serve_it(tmp_path, smollm2, capsys):
    """`selfspec export-vllm --output DIR` on the shipped model: the draft holds its config's exit layers and head,
    its weights in the dtype asked, and the lines it prints start vLLM with that directory."""
    from selfspec.cli import main

    model, _ = smollm2
    assert main(["export-vllm", "--output", str(tmp_path / "draft"), "--dtype", "float32"]) == 0
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] and config["selfspec_head"]["kind"] == "mlp"
    assert config["num_hidden_layers"] == config["selfspec_head"]["exit_layer"] >= 1
    tensors = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.float32}
    torch.testing.assert_close(tensors["model.layers.0.mlp.up_proj.weight"],
                               model.state_dict()["model.layers.0.mlp.up_proj.weight"], rtol=0, atol=0)
    printed = capsys.readouterr().out
    assert f'"model": "{tmp_path / "draft"}"' in printed and '"method": "eagle"' in printed


def test_export_refuses_what_vllm_cannot_draft_with(tmp_path):
    model, _ = _wrapped(tmp_path, context="early")
    with pytest.raises(ValueError, match="context top"):
        write_draft(model, tmp_path / "draft", target=str(tmp_path / "target"))
    model, _ = _wrapped(tmp_path)
    with pytest.raises(ValueError, match="local model directory"):
        write_draft(model, tmp_path / "draft", target=str(tmp_path / "nowhere"))
    gpt2 = make_model("gpt2", layers=4, dtype=torch.float32)
    selfspec.wrap(gpt2, exit_layer=2)
    with pytest.raises(ValueError, match="'gpt2'"):
        write_draft(gpt2, tmp_path / "draft", target=str(tmp_path / "target"))


def _lookup_by_hand(text: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """The rule read directly: the longest suffix of n_max ... n_min tokens that occurred before, continued from
    its most recent earlier occurrence, up to k tokens (never past the text's end)."""
    for n in range(min(n_max, len(text) - 1), n_min - 1, -1):
        suffix = text[-n:]
        for end in range(len(text) - 2, n - 2, -1):  # occurrences ending before the last token, latest first
            if text[end - n + 1: end + 1] == suffix:
                return text[end + 1: end + 1 + k]
    return []


def test_prompt_lookup_proposer_follows_the_rule():
    rng = random.Random(0)
    texts = [[rng.randrange(6) for _ in range(rng.randrange(1, 40))] for _ in range(200)]
    got = propose_rows([np.array(t) for t in texts], 5, 3, 1)
    assert got == [_lookup_by_hand(t, 5, 3, 1) for t in texts]


# --- vLLM itself --------------------------------------------------------------------------------------------------

VLLM_PYTHON = os.environ.get("SELFSPEC_VLLM_PYTHON")


def _fused_from_shipped(directory) -> tuple:
    """The shipped model with a fused head built from its shipped head, its layer weighing half (`mix` 0.5), set to
    draft K=4 every step as vLLM does, and exported to `directory`: (model, engine)."""
    from selfspec.pretrained import load

    model, _ = load("smollm2-135m", dtype="float32")
    engine = model.selfspec
    head = FusedHead.from_mlp(engine.heads[engine.config.exit_layer], engine.adapter)
    with torch.no_grad():
        head.mix.fill_(0.5)
    engine.add_head(head)
    engine.config.drafter, engine.config.copy_draft_tokens = "early_exit", 0
    engine.config.max_draft_tokens, engine.config.draft_confidence_threshold = 4, 0.0
    write_draft(model, str(directory))
    return model, engine


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON, reason="SELFSPEC_VLLM_PYTHON names no vLLM environment (scripts/vllm_env.sh)")
def test_vllm_serves_selfspecs_drafters_with_its_own_outputs(tmp_path, smollm2):
    """vLLM with selfspec's lookup (custom_class), the shipped head and a fused head (both EAGLE) gives vLLM's own
    float32 greedy tokens on two eval prompts, at one request and two at once. The shipped head's drafts are
    accepted (a broken draft model keeps the outputs, since vLLM's verifier decides, but not its acceptance), and a
    verify pass accepts as many of the fused head's drafts as selfspec's own engine does on the same prompts (a
    chain of the same length): its layer weighs half, which moves acceptance by about 0.3 tokens a pass, so a
    draft model that skipped or mis-cached the layer would give the outputs but not the acceptance."""
    from selfspec.serving.vllm_bench import workload

    export_vllm("smollm2-135m", str(tmp_path / "draft"))
    model, engine = _fused_from_shipped(tmp_path / "fused")
    # each engine runs in its bench child's own process (no engine-core and worker processes beside it): the same
    # engine and outputs, started in half the time
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(
        [VLLM_PYTHON, "-m", "selfspec.serving.vllm_bench", "--draft", str(tmp_path / "draft"), str(tmp_path / "fused"),
         "--dtype", "float32", "--enforce-eager", "--methods", "vllm", "selfspec-ngram", "selfspec-heads",
         "--ngram-tokens", "4",
         "--limit", "1", "--categories", "qa", "rag",
         "--max-new-tokens", "48", "--concurrency", "2", "--output", str(tmp_path / "bench")],
        env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert results["best"] == {"selfspec-ngram": {"one": "selfspec-ngram-4", "many": "selfspec-ngram-4"}}
    for name in ("selfspec-ngram-4", "selfspec-heads", "selfspec-heads-2"):
        for mode in ("one", "many"):
            row = results["methods"][name][mode]
            assert row["differs"] == 0 and row["near_tie"] == 0, (name, mode, results["verdicts"])
    assert results["methods"]["selfspec-heads"]["one"]["mean_accepted"] > 1.1
    accepted = steps = 0
    for p in workload(model.name_or_path, 1, ["qa", "rag"])[0]:
        model.generate(torch.tensor([p["ids"]]), max_new_tokens=48, do_sample=False)
        accepted += engine.last_stats.accepted_tokens
        steps += engine.last_stats.verify_steps - 1  # the prefill drafts nothing
    fused = results["methods"]["selfspec-heads-2"]["one"]["mean_accepted"]
    assert abs(fused - (1 + accepted / steps)) < 0.1, (fused, 1 + accepted / steps)


def test_the_vllm_bench_runs_each_lookup_at_every_length_and_names_its_fastest():
    """Baselines at their strongest: vLLM's n-gram method and selfspec's lookup get a row per draft length, and the
    report compares the head with each lookup's fastest row per load, not with one setting."""
    from selfspec.serving.vllm_bench import best_lookups, expand, method_specs, report

    rows = expand(["vllm", "vllm-ngram", "selfspec-heads"], [2, 4, 8])
    assert rows == ["vllm", "vllm-ngram-2", "vllm-ngram-4", "vllm-ngram-8", "selfspec-heads"]
    specs = method_specs({"directory": "d", "num_speculative_tokens": 3}, [2, 4, 8])
    assert specs["vllm-ngram-4"]["num_speculative_tokens"] == 4 and specs["vllm"] is None
    assert set(rows) <= set(specs)
    two = [{"directory": "d", "num_speculative_tokens": 3}, {"directory": "f", "num_speculative_tokens": 4}]
    assert expand(["vllm", "selfspec-heads"], [4], drafts=2) == ["vllm", "selfspec-heads", "selfspec-heads-2"]
    assert method_specs(two, [4])["selfspec-heads-2"] == {"method": "eagle", "model": "f", "num_speculative_tokens": 4}
    speed = {"vllm": (10, 10), "vllm-ngram-2": (15, 30), "vllm-ngram-4": (18, 20), "vllm-ngram-8": (16, 12),
             "selfspec-heads": (20, 15)}
    table = {name: {mode: {"tokens_per_s": v, "speedup": v / speed["vllm"][i], "mean_accepted": None,
                           "identical": 1, "near_tie": 0, "differs": 0}
                    for i, (mode, v) in enumerate(zip(("one", "many"), pair))} for name, pair in speed.items()}
    best = best_lookups(table)
    assert best == {"vllm-ngram": {"one": "vllm-ngram-4", "many": "vllm-ngram-2"}}
    text = report({"concurrency": 8, "vllm": "x", "dtype": "bfloat16", "prompts": 1, "max_new_tokens": 8,
                   "threads": "1", "command": "c", "methods": table, "best": best})
    assert ("- fastest vllm-ngram: 1 request: vllm-ngram-4 (1.80x), 8 at once: vllm-ngram-2 (3.00x); "
            "selfspec-heads against it: 1.11x, 0.50x") in text


def _proposer(k=6, max_model_len=200):
    """The proposer as vLLM builds it, from the two config fields it reads."""
    from types import SimpleNamespace

    from selfspec.serving.vllm_ngram import NgramProposer

    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                             model_config=SimpleNamespace(max_model_len=max_model_len))
    return NgramProposer(config)


def test_prompt_lookup_draft_length_follows_each_requests_acceptance():
    """transformers' schedule per request: one fewer after a failed draft, two more (up to k) after a whole one;
    a row that holds another request starts over at k."""
    proposer = _proposer(k=6)
    table = np.zeros((1, 200), dtype=np.int32)
    table[0, :96] = [1, 2, 3, 4, 5, 6, 7, 8] * 12  # every suffix recurs, with many tokens after it

    def drafted(length, sampled):
        return len(proposer.propose([sampled], np.array([length]), table)[0])

    assert drafted(16, [8]) == 6  # a new request: k
    assert drafted(17, [1]) == 5  # none of its 6 accepted (the step sampled only the target's token)
    assert drafted(18, [2]) == 4
    assert drafted(22, [3, 4, 5, 6, 7]) == 6  # all 4 accepted: 4 + 2
    assert drafted(23, [8]) == 5
    table[0, :40] = [5, 6] * 20  # another request moved into row 0: its most recent "5 6" leaves 2 tokens
    assert drafted(40, [6]) == 2 and proposer.requests[0].budget == 6

    proposer.adaptive = False
    table[0, 40] = 5
    drafted(41, [5])
    assert proposer.requests[0].budget == 6  # a failed draft changes nothing

