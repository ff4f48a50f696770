"""Memory of a wrapped generate against plain generate on a long prompt: no worse than plain, and given back after
the call. Each mode runs in a fresh process through `python -m selfspec.tools.memory`, since peak RSS is per
process."""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest


def _measure(mode: str, tokens: int = 4000) -> dict:
    cmd = [sys.executable, "-m", "selfspec.tools.memory", "--mode", mode, "--prompt-tokens", str(tokens), "--new-tokens", "16",
           "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_long_prompt_peak_and_release_match_plain_generate(smollm2):
    with ThreadPoolExecutor(2) as pool:  # peak RSS is each process's own, so the two modes may run side by side
        plain, wrapped = pool.map(_measure, ("plain", "wrapped"))
    assert wrapped["peak_mib"] <= 1.25 * plain["peak_mib"], (plain, wrapped)
    # the call's KV cache (~180 MiB here) must not stay with the process once generate has returned
    assert wrapped["rss_after_mib"] <= wrapped["rss_before_mib"] + 64, wrapped
