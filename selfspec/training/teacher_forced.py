"""Teacher-forced rows of chats: a conversation in the chat template, one forward pass, rows for its answers.

Each assistant turn is one sequence: its prompt is everything before the answer, its rows are up to
`prompt_context_tokens` positions before the answer (never inside an earlier answer) plus the answer (its content
and end-of-turn token). Several conversations share one forward call up to `batch_tokens` padded tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from selfspec import chat  # conversations -> model input, one rule for every stage

from .shards import FORMAT_VERSION, OutOfTime

TEXT_CHAIN = -1  # seq_chain of teacher-forced dataset text (0 = the model's greedy answer, 1.. = sampled ones)


class TemplateMismatch(ValueError):
    """The chat template renders a chat so that it is not a prefix of the chat's continuation."""


@dataclass
class Conversation:
    index: int  # position in the ShareGPT file
    id: str
    tokens: list  # chat-template token ids, cut after the last kept assistant token
    spans: list  # per assistant turn (p, q, finished): its tokens are [p, q); finished False if max_len cut it


def encode_conversation(tok, messages: list[dict], max_len: int, eos: set[int]) -> tuple[list[int], list[tuple]]:
    """Token ids of a chat in the tokenizer's chat template (plain dialogue without one) and its assistant spans,
    cut at ``max_len`` tokens. A plain text item is one span over all its tokens but the first.

    The text is tokenized in pieces split at the turn boundaries, as generation sees it: the prompt up to and
    including the assistant header on its own, then the answer. An answer's span is its content and its
    end-of-turn token; what the template adds after that token (a newline) belongs to the next prompt. A span
    cut by ``max_len`` is kept (finished False) when at least its first token fits."""
    text_item = bool(messages) and messages[0]["role"] == "text"

    def render(msgs, gen):
        if text_item:  # no prompt: the text is all answer
            return msgs[0]["content"] if msgs else ""
        return chat.render(tok, msgs, gen)

    def encode(text):  # the first piece starts the sequence (a BOS where plain text gets one)
        return chat.encode_text(tok, text, first=not ids, template=None if not text_item else False)

    ids, spans, done = [], [], ""
    for i, m in enumerate(messages):
        if m["role"] not in ("assistant", "text"):
            continue
        head, full = render(messages[:i], True), render(messages[:i + 1], False)
        if not head.startswith(done) or not full.startswith(head):
            raise TemplateMismatch("the chat template does not render a chat as a prefix of its continuation")
        ids += encode(head[len(done):])
        seg = encode(full[len(head):])
        if not ids:  # a text with no prompt: its first token is the context of the rest
            ids, seg = seg[:1], seg[1:]
        p = len(ids)
        if p >= max_len:
            break
        ends = [k for k, t in enumerate(seg) if t in eos]
        q = p + (ends[-1] + 1 if ends else len(seg))
        ids += seg
        done = full
        spans.append((p, min(q, max_len), q <= max_len))
        if len(ids) >= max_len:
            break
    end = spans[-1][1] if spans else 0
    return ids[:end], spans


def plan_conversations(tok, chats: list[tuple], max_len: int, eos: set[int]) -> tuple[list[Conversation], dict]:
    """Encode one shard's chats; those whose first answer starts beyond max_len (or whose template misbehaves)
    are skipped and counted."""
    out, skipped = [], {"n_skipped_long": 0, "n_skipped_template": 0}
    for index, cid, msgs in chats:
        try:
            tokens, spans = encode_conversation(tok, msgs, max_len, eos)
        except TemplateMismatch:
            skipped["n_skipped_template"] += 1
            continue
        if not spans:
            skipped["n_skipped_long"] += 1
            continue
        out.append(Conversation(index, cid, tokens, spans))
    return out, skipped


def _context_start(spans: list[tuple], k: int, keep: int) -> int:
    """First stored row of answer k: ``keep`` positions before it, but never a position of an earlier answer (an
    assistant token is stored once, and always with is_response 1); at least the last prompt position."""
    p = spans[k][0]
    prev_end = spans[k - 1][1] if k else 0
    return min(max(p - keep, prev_end), p - 1)


class _LayerInputs:
    """Forward pre-hooks that keep the input of each exit layer (hidden_states[E]) of the last forward call."""

    def __init__(self, model, layers: list[int]):
        from selfspec.arch import adapter_for

        self.out: dict[int, torch.Tensor] = {}
        self.handles = [adapter_for(model).layers[e].register_forward_pre_hook(self._hook(e), with_kwargs=True)
                        for e in layers]

    def _hook(self, e: int):
        def hook(module, args, kwargs):
            self.out[e] = args[0] if args else kwargs["hidden_states"]
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def length_batches(convs: list[Conversation], batch_tokens: int) -> list[list[Conversation]]:
    """Conversations sorted by length, grouped so that a forward call pads to at most ``batch_tokens`` tokens
    (a longer conversation goes alone)."""
    out, cur = [], []
    for conv in sorted(convs, key=lambda c: (len(c.tokens), c.index)):
        if cur and (len(cur) + 1) * len(conv.tokens) > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(conv)
    if cur:
        out.append(cur)
    return out


@torch.no_grad()
def teacher_forced_rows(model, pad_id: int, batch: list[Conversation], sc: dict, head_chunk: int = 512) -> dict:
    """One forward pass over a right-padded batch of conversations. Per conversation index: (tensors of its rows
    in the shard layout, [(first row position, p, q, finished)] per answer)."""
    layers = [int(e) for e in sc["exit_layers"]]
    store = getattr(torch, sc["store_dtype"])
    keep = max(int(sc["prompt_context_tokens"]), 1)
    device = next(model.parameters()).device
    width = max(len(c.tokens) for c in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for r, conv in enumerate(batch):
        ids[r, :len(conv.tokens)] = torch.tensor(conv.tokens)
        mask[r, :len(conv.tokens)] = 1
    cap = _LayerInputs(model, layers)
    try:
        out = model.get_decoder()(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
    finally:
        cap.remove()
    final = out.last_hidden_state  # after the final norm: the model's logits are lm_head(final)
    head = model.get_output_embeddings()

    flat, per_conv = [], []  # flat index (batch row * width + position) of every stored row, in shard order
    for r, conv in enumerate(batch):
        seqs = []
        for k, (p, q, fin) in enumerate(conv.spans):
            lo = _context_start(conv.spans, k, keep)
            flat.append(torch.arange(lo, q - 1) + r * width)
            seqs.append((lo, p, q, fin))
        per_conv.append(seqs)
    flat = torch.cat(flat).to(device)
    rows = {f"hidden.{e}": cap.out[e].reshape(-1, cap.out[e].shape[-1])[flat].to("cpu", store) for e in layers}
    fin_rows = final.reshape(-1, final.shape[-1])[flat]
    top1, prob = [], []
    for s in range(0, len(fin_rows), head_chunk):  # the full model's argmax and its probability, fp32 softmax
        pr = torch.softmax(head(fin_rows[s:s + head_chunk]).float(), dim=-1).max(dim=-1)
        top1.append(pr.indices.to("cpu", torch.int32))
        prob.append(pr.values.cpu())
    rows["hidden.final"] = fin_rows.to("cpu", store)
    rows["teacher_top1"] = torch.cat(top1)
    rows["teacher_top1_prob"] = torch.cat(prob)

    results, start = {}, 0
    for conv, seqs in zip(batch, per_conv):
        n = sum(q - 1 - lo for lo, _, q, _ in seqs)
        t = {k: v[start:start + n] for k, v in rows.items()}
        toks = torch.tensor(conv.tokens, dtype=torch.int32)
        pos = [torch.arange(lo, q - 1, dtype=torch.int32) for lo, _, q, _ in seqs]
        t["input_ids"] = torch.cat([toks[lo:q - 1] for lo, _, q, _ in seqs])
        t["target_ids"] = torch.cat([toks[lo + 1:q] for lo, _, q, _ in seqs])
        t["positions"] = torch.cat(pos)
        t["is_response"] = torch.cat([(ps >= p).to(torch.uint8) for ps, (_, p, _, _) in zip(pos, seqs)])
        results[conv.index] = (t, seqs)
        start += n
    return results


def teacher_forced_shard(model, pad_id: int, name: str, convs: list[Conversation], sc: dict, shash: str,
                         bar=None, deadline: float = float("inf")) -> tuple[dict, dict]:
    """Tensors and metadata of one teacher-forced shard: one sequence per assistant turn, conversations in file
    order. ``bar`` (tqdm) advances by the assistant tokens of each forward call."""
    t0 = time.perf_counter()
    results, n_forward, n_padded = {}, 0, 0
    for batch in length_batches(convs, int(sc["batch_tokens"])):
        if time.monotonic() > deadline:
            raise OutOfTime(name)
        results.update(teacher_forced_rows(model, pad_id, batch, sc))
        n_forward += sum(len(c.tokens) for c in batch)
        n_padded += len(batch) * max(len(c.tokens) for c in batch)
        if bar is not None:
            bar.update(sum(q - p for c in batch for p, q, _ in c.spans))
    seconds = time.perf_counter() - t0
    parts: dict[str, list] = {}
    offsets, seq_tokens, token_offsets, seq_meta = [0], [], [0], []
    cols = {k: [] for k in ("seq_prompt_len", "seq_first_pos", "seq_qid", "seq_turn", "seq_chain", "seq_finished")}
    for conv in convs:
        t, seqs = results[conv.index]
        for k, v in t.items():
            parts.setdefault(k, []).append(v)
        for turn, (lo, p, q, fin) in enumerate(seqs, 1):
            offsets.append(offsets[-1] + q - 1 - lo)
            seq_tokens.append(torch.tensor(conv.tokens[:q], dtype=torch.int32))
            token_offsets.append(token_offsets[-1] + q)
            for k, v in zip(cols, (p, lo, conv.index, turn, TEXT_CHAIN, int(fin))):
                cols[k].append(v)
            seq_meta.append({"conversation": conv.index, "id": conv.id, "turn": turn, "prompt_len": p,
                             "n_response_tokens": q - p, "finished": bool(fin)})
    tensors = {k: torch.cat(v).contiguous() for k, v in parts.items()}
    tensors["seq_offsets"] = torch.tensor(offsets, dtype=torch.int64)
    tensors["seq_tokens"] = torch.cat(seq_tokens)
    tensors["seq_token_offsets"] = torch.tensor(token_offsets, dtype=torch.int64)
    tensors.update({k: torch.tensor(v, dtype=torch.int32) for k, v in cols.items()})
    meta = {
        "format_version": FORMAT_VERSION, "settings_hash": shash, "name": name, "source": "sharegpt",
        "kind": "teacher_forced", "turn": 0, "sampled": False, "seqs": seq_meta,
        "stats": {"n_conversations": len(convs), "n_seqs": len(seq_meta),
                  "n_rows": int(tensors["input_ids"].numel()),
                  "n_response_tokens": sum(s["n_response_tokens"] for s in seq_meta),
                  "n_forward_tokens": n_forward, "n_padded_tokens": n_padded, "gen_seconds": round(seconds, 2)},
    }
    return tensors, meta
