"""What the wheel installs: the selfspec package with its data (shipped heads, Spec-Bench, search spaces), and no
top-level `train` (it would shadow any user's train.py). The repository's train/ scripts and the old module paths
stay runnable as aliases of the moved code."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the source (so that the build writes nothing into the checkout)."""
    pytest.importorskip("setuptools")  # --no-build-isolation: the build uses the installed setuptools
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("selfspec", "train"):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = (tmp / "dist").glob("selfspec-*.whl")
    return path


def test_wheel_installs_selfspec_only_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"selfspec"}, top  # no top-level train (nor anything else)
    assert (ROOT / "train" / "collect.py").is_file()  # ... although the source tree has it
    shipped = {p.name for p in (ROOT / "selfspec" / "tools" / "calibrate" / "search_spaces").glob("*.yaml")}
    assert {"default.yaml", "smollm2-135m.yaml"} <= shipped
    for name in shipped:
        assert f"selfspec/tools/calibrate/search_spaces/{name}" in names
    for module in ("selfspec/training/train_heads.py", "selfspec/training/eval_heads.py",
                   "selfspec/training/collect.py", "selfspec/training/agreement.py",
                   "selfspec/tools/measure.py", "selfspec/tools/replay.py",
                   "selfspec/assets/spec_bench/question.jsonl"):
        assert module in names


def test_installed_calibrator_finds_its_search_spaces(wheel, tmp_path):
    """From the unpacked wheel, in a directory without configs/: the default space is the shipped one."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import selfspec.tools.calibrate as c; p = c.default_space_path('smollm2-135m'); "
            "assert p.is_file() and p.is_relative_to(c.SEARCH_SPACES), p; "
            "assert str(c.SEARCH_SPACES).startswith(%r), c.SEARCH_SPACES; "
            "c.load_search_spec('default'); print('OK')" % str(site))
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


@pytest.mark.parametrize("old,new", [("selfspec.bench", "selfspec.tools.bench"),
                                     ("selfspec.calibrate", "selfspec.tools.calibrate"),
                                     ("train.train_heads", "selfspec.training.train_heads"),
                                     ("train.eval_heads", "selfspec.training.eval_heads"),
                                     ("train.collect", "selfspec.training.collect"),
                                     ("train.agreement", "selfspec.training.agreement")])
def test_old_paths_are_the_moved_modules(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


@pytest.mark.parametrize("command", [["-m", "selfspec.bench"], ["-m", "selfspec.calibrate"],
                                     ["-m", "train.train_heads"], ["-m", "train.eval_heads"],
                                     ["-m", "train.collect"], ["-m", "train.agreement"],
                                     ["train/train_heads.py"]])
def test_old_commands_run(command):
    out = subprocess.run([sys.executable, *command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr[-2000:]
