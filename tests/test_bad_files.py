"""A bad file that selfspec reads -- heads, their config, a prompt or data JSONL, a model directory -- stops the
command line with one line on stderr that names the file (and the line of a JSONL) and says the fix; --debug
shows the traceback instead. Each test runs the real `selfspec` in a subprocess on tiny files built here."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest

from selfspec import cli
from test_cli import save_tiny_model

# offline, and without the weight-loading progress bar, which writes its own lines to stderr
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1"}


def process(*args, cwd=None):
    """The real `selfspec` command in a process of its own."""
    return subprocess.run([sys.executable, "-m", "selfspec.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=ENV, cwd=cwd)


def selfspec(*args):
    """`selfspec ARGS` through the command line's own entry point, in this process (no interpreter to start):
    its exit status and what it wrote to stderr."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = cli.main([str(a) for a in args])
    finally:
        logging.enable_progress_bar()
    return subprocess.CompletedProcess(args, code, "", err.getvalue())


def assert_one_line(out, *words):
    """Exit status 2 and stderr exactly one line, holding every word."""
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for word in words:
        assert str(word) in lines[0], lines[0]
    assert "Fix:" in lines[0], lines[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny model directory and heads saved for it, with a weighted (MLP) head so that heads.safetensors exists."""
    import selfspec as ss
    from transformers import AutoModelForCausalLM

    from selfspec.heads import MLPHead

    root = tmp_path_factory.mktemp("bad-files")
    model_dir = save_tiny_model(root / "model")
    model = ss.wrap(AutoModelForCausalLM.from_pretrained(model_dir), exit_layer=2)
    model.selfspec.add_head(MLPHead(2, 32, 16))
    model.selfspec.save_pretrained(str(root / "heads"))
    return {"root": root, "model": model_dir, "heads": root / "heads"}


def heads_copy(files, name):
    path = files["root"] / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(files["heads"], path)
    return path


def test_a_truncated_heads_file_is_one_line(files):
    heads = heads_copy(files, "truncated")
    weights = heads / "heads.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])  # the header cut short
    assert_one_line(process("generate", "--model", files["model"], "--heads", heads, "w1"), weights,
                    "selfspec generate: error:")


def test_a_foreign_heads_file_is_one_line(files):
    import torch
    from safetensors.torch import save_file

    heads = heads_copy(files, "foreign")
    weights = heads / "heads.safetensors"
    save_file({"embed.weight": torch.zeros(4, 4)}, str(weights))  # a valid file of something else's tensors
    assert_one_line(selfspec("generate", "--model", files["model"], "--heads", heads, "w1"), weights, "layer2.")


@pytest.mark.parametrize("shape,words", [
    ("not json", ["not JSON"]),
    ("array", ["a JSON array"]),
    ("wrong type", ["exit_layer", "'two'", "an integer"]),
    ("unknown field", ["exit_layr"]),
    ("heads not a list", ["heads"]),
    ("head spec without its rank", ["exit-layer-2 head", "no 'rank' field"]),
    ("exit layer out of range", ["exit_layer=99", "1 <= exit_layer <= 3"]),
])
def test_a_config_of_the_wrong_shape_is_one_line(files, shape, words):
    heads = heads_copy(files, "config-" + shape.replace(" ", "-"))
    config = heads / "selfspec_config.json"
    saved = json.loads(config.read_text())
    text = {"not json": config.read_text()[:300],
            "array": "[1, 2]",
            "wrong type": json.dumps({**saved, "exit_layer": "two"}),
            "unknown field": json.dumps({**saved, "exit_layr": 2}),
            "heads not a list": json.dumps({**saved, "heads": "mlp"}),
            "exit layer out of range": json.dumps({**saved, "exit_layer": 99}),
            "head spec without its rank": json.dumps({**saved, "heads": [
                {k: v for k, v in h.items() if k != "rank"} for h in saved["heads"]]})}[shape]
    config.write_text(text)
    assert_one_line(selfspec("generate", "--model", files["model"], "--heads", heads, "w1"), config, *words)


@pytest.mark.parametrize("case,content,words", [
    ("not JSON", b'{"turns": ["w1 w2"]}\n\n{"turns": [w3\n', [":3: not JSON"]),  # line 3, after a blank line
    ("no object", b'{"turns": ["w1 w2"]}\n["w3"]\n', [":2:", "'turns'"]),
    ("not UTF-8", '{"turns": ["caf\u00e9"]}\n'.encode("latin-1"), [" is not UTF-8 text", "save it as UTF-8"]),
])
def test_a_bad_prompts_file_names_file_and_line(files, case, content, words):
    prompts = files["root"] / f"prompts-{case.replace(' ', '-')}.jsonl"
    prompts.write_bytes(content)
    out = selfspec("bench", "--model", files["model"], "--prompts", prompts, "--methods", "selfspec", "--output",
                   files["root"] / "bench-out")
    assert_one_line(out, "selfspec bench: error:", *[f"{prompts}{w}" if w.startswith((":", " ")) else w
                                                      for w in words])


def test_a_broken_data_line_names_file_and_line(files):
    data = files["root"] / "data.jsonl"
    data.write_text('{"text": "w1 w2 w3"}\n{broken\n')
    out = selfspec("prepare", files["model"], "--output", files["root"] / "prepared", "--data", data)
    assert_one_line(out, f"{data}:2: not JSON", "selfspec prepare: error:")


@pytest.fixture(scope="module")
def no_weights(files):
    """The tiny model's directory with config.json and tokenizer but its weights removed."""
    path = files["root"] / "no-weights"
    shutil.copytree(files["model"], path)
    for file in path.iterdir():
        if file.suffix in (".safetensors", ".bin"):
            file.unlink()
    assert (path / "config.json").is_file()
    return path


@pytest.mark.parametrize("command", ["generate", "bench", "prepare"])
def test_a_model_directory_without_weights_is_one_line(files, no_weights, command):
    argv = {"generate": ["generate", "--model", no_weights, "w1"],
            "bench": ["bench", "--model", no_weights, "--methods", "selfspec", "--output", files["root"] / "b"],
            "prepare": ["prepare", no_weights, "--output", files["root"] / "p", "--data", files["root"] / "x"]}
    if command == "prepare":
        (files["root"] / "x").write_text('{"text": "w1 w2 w3"}\n')
    out = selfspec(*argv[command])
    assert_one_line(out, str(no_weights), "no weights", f"selfspec {command}: error:")
    assert not (files["root"] / "p").exists()  # prepare refuses before it writes anything


def test_debug_shows_the_traceback(files):
    heads = heads_copy(files, "debug")
    (heads / "heads.safetensors").write_bytes(b"\0" * 16)
    out = process("generate", "--debug", "--model", files["model"], "--heads", heads, "w1")
    assert out.returncode != 0 and "Traceback" in out.stderr, out.stderr
    assert "heads.safetensors" in out.stderr.splitlines()[-1]

