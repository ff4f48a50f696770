"""The model's own answers, with the states a teacher-forced pass over them would give.

One shard is one batched `generate` call over prompts of one chain (greedy or sampled); forward hooks keep, from
the generation's own forward calls, each exit layer's input, the final-normed state and the full model's argmax at
every answer position and the last `prompt_context_tokens` prompt positions (collect.py's docstring has the layout).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from selfspec import chat  # conversations -> model input, one rule for every stage
from selfspec.prompts import left_pad
from selfspec.tools.measure import eos_ids_of

from .shards import FORMAT_VERSION, OutOfTime, shard_seed


@dataclass
class Job:
    qid: int
    category: str
    turn: int
    chain: int
    messages: list
    prompt_ids: list | None = None

    @property
    def sampled(self) -> bool:
        return self.chain > 0


def turn_jobs(questions, turn: int, n_chains: int, answers: dict | None) -> list[Job]:
    """Jobs of one turn; turn 2 needs ``answers[(qid, chain)]`` = that chain's turn-1 text."""
    jobs = []
    for q in questions:
        if len(q["turns"]) < turn:
            continue
        for c in range(n_chains):
            msgs = []
            for t in range(turn - 1):
                msgs.append({"role": "user", "content": q["turns"][t]})
                msgs.append({"role": "assistant", "content": answers[(q["question_id"], c)]})
            msgs.append({"role": "user", "content": q["turns"][turn - 1]})
            jobs.append(Job(q["question_id"], q["category"], turn, c, msgs))
    return jobs


def encode_prompts(tok, jobs: list[Job]) -> None:
    for j in jobs:
        j.prompt_ids = chat.encode(tok, j.messages)


def plan_shards(jobs: list[Job], batch_size: int) -> list[tuple[str, list[Job]]]:
    """Split one turn's jobs into shards, one group per chain (greedy and sampled never share
    a call, as ``do_sample`` is per call; adding chains later only adds shards), each group
    sorted by prompt length so left padding stays small. Deterministic given the jobs."""
    shards = []
    for chain in sorted({j.chain for j in jobs}):
        group = sorted((j for j in jobs if j.chain == chain), key=lambda j: (len(j.prompt_ids), j.qid))
        for i in range(0, len(group), batch_size):
            shards.append((f"t{group[0].turn}-c{chain}-{i // batch_size:03d}", group[i:i + batch_size]))
    return shards


class _Capture:
    """Forward hooks that keep, during ``generate``, what a teacher-forced pass would give:
    the input of each exit layer, the output of the final norm (both per forward call) and
    the argmax / max-probability of the LM head's raw logits at the last position."""

    def __init__(self, model, layers: list[int], keep_prompt: int, dtype: torch.dtype):
        self.layers, self.keep_prompt, self.dtype = layers, keep_prompt, dtype
        self.hidden = {e: [] for e in layers}
        self.final, self.top1, self.top1_prob = [], [], []
        from selfspec.arch import adapter_for

        adapter = adapter_for(model)  # the family's own names for the decoder layers and the final norm
        self.handles = [adapter.layers[e].register_forward_pre_hook(self._pre(e), with_kwargs=True)
                        for e in layers]
        self.handles.append(adapter.norm.register_forward_hook(self._on_norm))
        self.handles.append(model.get_output_embeddings().register_forward_hook(self._on_head))

    def _tail(self, x: torch.Tensor) -> torch.Tensor:
        # prefill: only the last prompt columns are stored; copy so the big tensor can be freed
        return x[:, -self.keep_prompt:] if x.shape[1] > 1 else x

    # everything kept moves to the CPU at once: the shard is assembled and written there, and a CUDA run
    # keeps no growing list of activations on the device
    def _pre(self, e: int):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.hidden[e].append(self._tail(h).to(device="cpu", dtype=self.dtype, copy=True))
        return hook

    def _on_norm(self, module, args, out):
        # kept in the model's dtype: the LM head reads exactly these values
        self.final.append(self._tail(out).to(device="cpu", copy=True))

    def _on_head(self, module, args, out):
        prob, idx = torch.softmax(out[:, -1].float(), dim=-1).max(dim=-1)
        self.top1.append(idx.to(device="cpu", dtype=torch.int32))
        self.top1_prob.append(prob.cpu())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def generate_batch(model, tok, jobs: list[Job], c: dict, seed: int, deadline: float = float("inf")
                   ) -> tuple[list[list[int]], list[bool], dict]:
    """Generate the responses of one shard and gather its rows (see the module docstring).

    Responses are cut after the first eos; ``finished`` says whether each ended with eos.
    Hidden states come from the generation forward calls themselves (prefill for the prompt
    rows, decode step j + 1 for response token j), so no second pass is needed; the last token
    of each sequence is never fed back to the model and so has no row. Generation that reaches
    ``deadline`` (time.monotonic) stops there and raises OutOfTime: the shard would be cut short.
    """
    layers = [int(e) for e in c["exit_layers"]]
    dtype = getattr(torch, c["store_dtype"])
    pad = tok.pad_token_id
    width = max(len(j.prompt_ids) for j in jobs)
    # the last prompt position predicts response token 0, so at least it is kept
    keep = min(max(int(c["prompt_context_tokens"]), 1), width)
    ids, mask = left_pad([j.prompt_ids for j in jobs], pad)
    sampled = jobs[0].sampled
    kw = dict(do_sample=True, temperature=float(c["temperature"]), top_p=float(c["top_p"]), top_k=0) \
        if sampled else dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    torch.manual_seed(seed)
    cap = _Capture(model, layers, keep, dtype)
    device = next(model.parameters()).device
    if deadline < float("inf"):
        kw["max_time"] = max(deadline - time.monotonic(), 0.0)
    try:
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=int(c["max_new_tokens"]), pad_token_id=pad, **kw)
    finally:
        cap.remove()
    if time.monotonic() > deadline:
        raise OutOfTime("generation reached the time budget")
    n_steps = out.shape[1] - width
    if len(cap.final) != n_steps or len(cap.top1) != n_steps:
        raise RuntimeError(f"expected {n_steps} forward calls during generate, hooks saw {len(cap.final)}")

    eos = set(eos_ids_of(model, tok))
    responses, finished = [], []
    for row in out[:, width:].cpu().tolist():
        cut = next((k for k, t in enumerate(row) if t in eos), None)
        responses.append(row if cut is None else row[:cut + 1])
        finished.append(cut is not None)
    return responses, finished, answer_rows(model, jobs, responses, cap, keep, n_steps)


def answer_rows(model, jobs: list[Job], responses: list[list[int]], cap: _Capture, keep: int, n_steps: int) -> dict:
    """The shard's rows from what the hooks kept over `n_steps` forward calls: per sequence, its last `keep` prompt
    positions (from the prefill) and its answer's positions (one decode step each), concatenated."""
    layers, dtype = cap.layers, cap.dtype

    # (B, keep, H) prompt tails and (B, n_steps - 1, H) decode steps, per stored tensor
    def split(calls):
        dec = torch.cat(calls[1:], dim=1) if n_steps > 1 else calls[0][:, :0]
        return calls[0], dec
    hid = {e: split(cap.hidden[e]) for e in layers}
    fin = split(cap.final)
    top1 = torch.stack(cap.top1, dim=1)  # (B, n_steps): column k = prediction after call k
    top1_prob = torch.stack(cap.top1_prob, dim=1)
    head = model.get_output_embeddings()

    cols: dict[str, list] = {k: [] for k in [f"hidden.{e}" for e in layers] + [
        "hidden.final", "input_ids", "target_ids", "positions", "is_response", "teacher_top1",
        "teacher_top1_prob"]}
    first_pos = []
    for r, (j, resp) in enumerate(zip(jobs, responses)):
        p, n_resp = len(j.prompt_ids), len(resp)
        lo = max(p - keep, 0)
        a, b = keep - p + lo, keep  # prompt rows lo..p-1 in the prefill tail
        for e in layers:
            cols[f"hidden.{e}"].append(torch.cat([hid[e][0][r, a:b], hid[e][1][r, :n_resp - 1]]))
        h_fin = torch.cat([fin[0][r, a:b], fin[1][r, :n_resp - 1]])
        cols["hidden.final"].append(h_fin.to(dtype))
        # teacher argmax: prompt rows except the last from the LM head here (in its own dtype and device, as the
        # model computed the others), the others from the hook
        pr = torch.softmax(head(h_fin[:p - 1 - lo].to(head.weight.device, head.weight.dtype)).float(),
                           dim=-1).max(dim=-1)
        pr = pr.values.cpu(), pr.indices.cpu()
        cols["teacher_top1"].append(torch.cat([pr[1].to(torch.int32), top1[r, :n_resp]]))
        cols["teacher_top1_prob"].append(torch.cat([pr[0], top1_prob[r, :n_resp]]))
        toks = torch.tensor(j.prompt_ids + resp, dtype=torch.int32)
        n = p + n_resp
        cols["input_ids"].append(toks[lo:n - 1])
        cols["target_ids"].append(toks[lo + 1:n])
        pos = torch.arange(lo, n - 1, dtype=torch.int32)
        cols["positions"].append(pos)
        cols["is_response"].append((pos >= p).to(torch.uint8))
        first_pos.append(lo)
    lens = [len(v) for v in cols["input_ids"]]
    tensors = {k: torch.cat(v).contiguous() for k, v in cols.items()}
    tensors["seq_offsets"] = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    tensors["seq_first_pos"] = torch.tensor(first_pos, dtype=torch.int32)
    return tensors


def run_shard(model, tok, name: str, jobs: list[Job], c: dict, shash: str,
              deadline: float = float("inf")) -> tuple[dict, dict]:
    seed = shard_seed(int(c["seed"]), name)
    t0 = time.perf_counter()
    responses, finished, tensors = generate_batch(model, tok, jobs, c, seed, deadline)
    t1 = time.perf_counter()
    seqs = [j.prompt_ids + r for j, r in zip(jobs, responses)]
    prompt_lens = [len(j.prompt_ids) for j in jobs]
    tensors["seq_tokens"] = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    tensors["seq_token_offsets"] = torch.tensor([0] + [len(s) for s in seqs], dtype=torch.int64).cumsum(0)
    tensors["seq_prompt_len"] = torch.tensor(prompt_lens, dtype=torch.int32)
    tensors["seq_qid"] = torch.tensor([j.qid for j in jobs], dtype=torch.int32)
    tensors["seq_turn"] = torch.tensor([j.turn for j in jobs], dtype=torch.int32)
    tensors["seq_chain"] = torch.tensor([j.chain for j in jobs], dtype=torch.int32)
    tensors["seq_finished"] = torch.tensor(finished, dtype=torch.int32)
    n_resp = sum(len(r) for r in responses)
    meta = {
        "format_version": FORMAT_VERSION,
        "settings_hash": shash,
        "name": name,
        "turn": jobs[0].turn,
        "sampled": jobs[0].sampled,
        "seed": seed,
        "seqs": [{"qid": j.qid, "category": j.category, "turn": j.turn, "chain": j.chain,
                  "prompt_len": len(j.prompt_ids), "n_response_tokens": len(r), "finished": f,
                  "response_text": tok.decode(r, skip_special_tokens=True).strip()}
                 for j, r, f in zip(jobs, responses, finished)],
        "stats": {"n_seqs": len(jobs), "n_rows": int(tensors["input_ids"].numel()),
                  "n_response_tokens": n_resp, "gen_seconds": round(t1 - t0, 2)},
    }
    return tensors, meta
