"""The pagedkit arm: one (batch, context) row through `pagedkit.engine.Engine`.

B requests of random prompts of `context - decode_steps` tokens are submitted at once (greedy,
ignore_eos, prefix caching off). TTFT: from submitting to the step after which every request has its
first token (the batch's prefill; `ttft_first_ms`: the first request's). Then `decode_steps` engine
steps are timed one by one (each ends with the logits' copy to the host, which waits for the device;
on CUDA an explicit synchronize too): tokens/s = tokens emitted in those steps / their total time,
ms_per_step = the median step. The cached context at the last timed step is `context` tokens.
With overlap (engine.overlap: decode steps one step ahead of the host) one untimed step first launches the
first decode step; each timed step() then launches the next step and returns the previous one's tokens, and
is not followed by a synchronize (that would undo the overlap): its time runs from one call to the next, so
the timed calls together cover decode_steps steps' worth of device time and host work.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
import time
from dataclasses import dataclass

from ...engine import Engine, SamplingParams


@dataclass(frozen=True)
class Row:
    """One measured shape: batch sequences, `context` cached tokens at the last decode step."""

    batch: int
    context: int
    decode_steps: int
    headroom: int = 0  # decode steps an early request may run while later ones still prefill (chunked prefill)

    @property
    def prompt_tokens(self) -> int:
        return self.context - self.decode_steps - self.headroom


def with_headroom(row: Row, max_num_tokens: int, lookahead: int = 0) -> Row:
    """The row with prompts shortened by the steps a chunked prefill takes after the first request's first token
    (and by `lookahead`: the step an overlapping engine runs ahead of the timed ones), so no request reaches the
    context before the timed steps end and every timed step decodes all B sequences."""
    steps = lookahead
    if row.batch * row.prompt_tokens > max_num_tokens:
        steps += math.ceil(row.batch * row.prompt_tokens / max(1, max_num_tokens - row.batch))
    return dataclasses.replace(row, headroom=steps) if steps else row


def prompts_for(row: Row, vocab: int, seed: int) -> list[list[int]]:
    """row.batch random prompts of row.prompt_tokens ids in [3, vocab) (same seed, same prompts)."""
    rng = random.Random(seed)
    lo = 3 if vocab > 3 else 0
    return [[rng.randrange(lo, vocab) for _ in range(row.prompt_tokens)] for _ in range(row.batch)]


def prefill_steps(row: Row, max_num_tokens: int) -> int:
    """Engine steps the batch's prefill may take under the token budget (chunked prefill; requests that
    have their first token take one token of the budget each step), with a margin."""
    return math.ceil(row.batch * row.prompt_tokens / max(1, max_num_tokens - row.batch)) + 2


def max_new_tokens(row: Row, max_num_tokens: int, max_seq_len: int) -> int:
    """Tokens each request may generate: the first token, the timed steps, and the decode steps that
    early requests run while later ones still prefill; capped by the context length."""
    return min(row.decode_steps + 1 + prefill_steps(row, max_num_tokens), max_seq_len + 1 - row.prompt_tokens)


def blocks_needed(row: Row, max_num_tokens: int, max_seq_len: int, block_size: int) -> int:
    """Full-attention blocks the row's B requests can hold at most (the engine's pool size for it)."""
    longest = min(row.prompt_tokens + max_new_tokens(row, max_num_tokens, max_seq_len) - 1, max_seq_len)
    return row.batch * math.ceil(longest / block_size)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def run_row(engine: Engine, row: Row, prompts: list[list[int]], device: str) -> dict:
    """Measure one row; returns the arm's JSON record (tokens: every request's greedy tokens)."""
    params = SamplingParams(max_new_tokens=max_new_tokens(row, engine.max_num_tokens, engine.max_seq_len),
                            ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    pg0 = engine.stats.prefill_graph_steps
    _sync(device)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    for rid in ids:
        tokens[rid] = []
    try:
        prefill = 0
        while len(first) < len(ids):
            outs = engine.step()
            _sync(device)
            now = time.perf_counter()
            prefill += 1
            _collect(outs, tokens, first, now)
            if prefill > 10 * prefill_steps(row, engine.max_num_tokens) + 10:
                raise RuntimeError(f"the engine made no progress on the prefill of {row} after {prefill} steps")
        ttft = max(first.values()) - t0
        prefill_graphed = engine.stats.prefill_graph_steps - pg0
        ttft_first = min(first.values()) - t0
        times, emitted, smallest = [], 0, row.batch
        graphs = engine.model.graphs
        replays0 = graphs.stats.replays if graphs is not None else 0
        overlap = getattr(engine, "overlap", False)
        if overlap:  # launch the first decode step (its tokens come out of the first timed step)
            _collect(engine.step(), tokens, first, 0.0)
            _sync(device)
        for _ in range(row.decode_steps):
            s = time.perf_counter()
            outs = engine.step()
            if not overlap:
                _sync(device)
            times.append(time.perf_counter() - s)
            _collect(outs, tokens, first, 0.0)
            n = sum(len(o.new_token_ids) for o in outs)
            emitted += n
            smallest = min(smallest, sum(1 for o in outs if o.new_token_ids))
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    total = sum(times)
    rec = {"ttft_ms": ttft * 1e3, "ttft_first_ms": ttft_first * 1e3, "prefill_steps": prefill,
           "ms_per_step": statistics.median(times) * 1e3, "ms_per_step_mean": total / len(times) * 1e3,
           "tokens_per_s": emitted / total if total > 0 else None, "decode_tokens": emitted,
           "min_sequences_per_step": smallest,
           "cuda_graphs": graphs is not None and graphs.capture, "overlap": overlap,
           "overlapped_steps": engine.stats.overlapped_steps,
           "graph_replays": (graphs.stats.replays - replays0) if graphs is not None else 0,
           "prefill_graph_steps": prefill_graphed,  # prefill steps a prefill graph served (engine/prefill_graphs.py)
           "tokens": [tokens[rid] for rid in ids]}
    if smallest < row.batch:
        rec["note"] = (f"some timed steps decoded only {smallest} of {row.batch} sequences (the context length "
                       "ended requests that started decoding during a chunked prefill)")
    return rec


def _collect(outs, tokens: dict, first: dict, now: float) -> None:
    for o in outs:
        if o.request_id not in tokens:
            continue
        if o.finish_reason == "abort":
            raise RuntimeError(f"request {o.request_id} aborted by the engine: {o.reason}")
        tokens[o.request_id] += o.new_token_ids
        if o.new_token_ids and o.request_id not in first:
            first[o.request_id] = now
