"""Compile every pass a config can make before the first request, as a serving engine does.

    model = selfspec.wrap(model, "heads/", compile=True)
    model.selfspec.warmup()                  # minutes on a CPU; afterwards no generate call compiles anything

With `compile=True` each pass shape (a layer range at a number of query tokens, the LM head, an exit head and its
draft rows, a stateful head's own pass) compiles the first time it runs. Which shapes a config makes is known before
any request: the split layer E gives the layer ranges, the widest draft (K, a copying chain, a tree) gives the query
counts, and the head at E gives the head passes. `warm_up` runs each of them once on a throwaway cache, through the
same Runner the decode loop uses, so the graphs it compiles are the ones requests then reuse.
"""
from __future__ import annotations

import time

import torch

from .cache import SlotTable, SpecCache
from .decoding import DecodeSettings, call_capacity
from .draft_logits import lm_logits
from .head_state import HeadCache
from .runner import Runner

PROMPT = 8  # tokens of the throwaway prompt the passes run after (any length: the cache length is dynamic)


def pass_sizes(compiled, widest: int) -> list[int]:
    """One query count per compiled shape that passes of 1..widest tokens run at."""
    seen, sizes = set(), []
    for t in range(1, widest + 1):
        rows, key = compiled.size(t)
        if rows is not None and key not in seen:
            seen.add(key)
            sizes.append(t)
    return sizes


@torch.no_grad()
def warm_up(engine, batch_sizes=(1,), max_length: int = 2048, progress: bool = True) -> float:
    """Compile every pass shape `engine`'s config makes, greedy and (where its config differs) sampled, for each batch
    size. Returns the seconds it took; 0 where the engine runs eager."""
    device = engine.adapter.device_of_layer(0)
    compiled = engine.compiled_step(device)
    if compiled is None:
        return 0.0
    start = time.perf_counter()
    plans = [_plan(engine.for_mode(sample), compiled, max_length) for sample in _modes(engine)]
    work = [(b, plan, t) for b in batch_sizes for plan in plans for t in plan["sizes"]]
    from tqdm import tqdm

    for b, plan, t in tqdm(work, desc="selfspec warm-up", unit="shape", disable=not progress):
        _run_passes(engine, compiled, plan, b, t)
    seconds = time.perf_counter() - start
    if progress:
        print(f"selfspec: warm-up compiled {len(work)} pass sizes in {seconds:.0f} s")
    return seconds


def _modes(engine) -> list[bool]:
    """Greedy, and sampled too where the config holds other settings for sampling."""
    return [False] if engine.config.for_mode(True) is engine.config else [False, True]


def _plan(engine, compiled, max_length: int) -> dict:
    """What a call of this engine runs: its layer ranges, its pass sizes, the head at its split layer."""
    drafter = engine.build_drafter()
    settings = engine.call_settings(drafter, DecodeSettings(max_length=max_length))
    engine.fit_compiled(compiled, settings)
    compiled.least_capacity = max(compiled.least_capacity, compiled.capacity(call_capacity(settings, 0)))
    e, layers = settings.exit_layer, engine.adapter.num_layers
    widest = max(settings.max_draft_tokens, settings.copy_draft_tokens, settings.tree_size) + 1
    head = engine.head_for(e) if drafter.uses_early_layers else None
    return {"ranges": [(0, e), (e, layers)] if e < layers else [(0, layers)], "exit_layer": e,
            "sizes": pass_sizes(compiled, widest), "head": head,
            "capacity": call_capacity(settings, PROMPT)}


def _run_passes(engine, compiled, plan: dict, batch: int, tokens: int) -> None:
    """Each pass of `tokens` query tokens a call of `plan` makes, on a fresh cache that holds a prompt."""
    adapter = engine.adapter
    runner = Runner(adapter, SpecCache(adapter.num_layers), SlotTable(batch, adapter.device_of_layer(0),
                                                                       plan["capacity"], batch > 1), compiled)
    runner.cache.reserve(compiled.capacity(plan["capacity"]))
    ids = torch.zeros(batch, PROMPT, dtype=torch.long, device=runner.slots.pos.device)
    prompt, prompt_positions = runner.prompt(ids, None, adapter.num_layers)  # eager: allocates every layer's buffer
    positions = PROMPT + torch.arange(tokens, device=ids.device).expand(batch, tokens)
    hidden = runner.adapter.embed(ids[:, :1].expand(batch, tokens), positions)
    for start, stop in plan["ranges"]:
        out = runner.run(start, stop, hidden, positions)
        if start == 0:
            early = out
        runner.cache.rollback(PROMPT)
    normed = runner.adapter.final_norm(out)
    runner.adapter.logits(normed)
    head = plan["head"]
    if head is not None and head.stateful:  # its own pass, after the prompt fed eager as a call's first is
        states = HeadCache(head, runner.own_cache())
        states.feed(runner, prompt, prompt_positions, prompt if head.reads_top else None)
        own = states.feed(runner, early, positions, normed if head.reads_top else None)
        own = own if head.reads_top else runner.adapter.final_norm(own)
        lm_logits(runner.adapter, own, head.vocab_ids)
    elif head is not None:
        own = head.normed(early, runner.adapter, normed if head.reads_top else None)
        lm_logits(runner.adapter, own, head.vocab_ids)
