"""Several completions of one prompt (`Engine.add_group`, OpenAI's `n`): the prompt is prefilled once.

The group's first request (the parent) is queued as usual; the others (its siblings) are registered (their
ids are live: they can be aborted) but wait with it. The parent is admitted only when the batch has room
for the whole group. When the parent's prompt is all cached (its last prefill chunk ran), each sibling
still alive gets the parent's blocks (`KVCacheManager.fork`: shared by reference count, the partly filled
last block copied on its first write) and chooses its first token from the same logits row as the parent,
with its own generator; from then on the siblings are running requests like any other (preempted, they
recompute alone). If the parent ends before its prompt is cached (aborted), its live siblings are queued
at the front on their own.
"""

from __future__ import annotations

from typing import Sequence

from .params import SamplingParams
from .request import RUNNING, Request


def check_group(params: Sequence[SamplingParams], max_batch_size: int) -> None:
    if not params:
        raise ValueError("add_group: expected at least one SamplingParams")
    if len(params) > max_batch_size:
        raise ValueError(f"add_group: a group of {len(params)} requests cannot run together: the engine's "
                         f"max_batch_size is {max_batch_size}")
    first = {k: v for k, v in vars(params[0]).items() if k != "seed"}
    for p in params[1:]:
        if not isinstance(p, SamplingParams) or {k: v for k, v in vars(p).items() if k != "seed"} != first:
            raise ValueError("add_group: the requests of a group share their SamplingParams (their seeds may differ)")


def pending(r: Request) -> int:
    """Siblings of r that wait for its prompt (not aborted)."""
    return sum(not s.finished for s in r.siblings)


def fork_siblings(engine, parent: Request, rows, row: int, outputs: list) -> None:
    """The parent's prompt is cached and it chose its first token from logits row `row`: every live sibling
    shares its blocks and chooses its own first token from the same row."""
    siblings, parent.siblings = parent.siblings, []
    for s in siblings:
        if s.finished:
            continue
        engine.kv.fork(parent.request_id, s.request_id)
        engine._admissions += 1
        s.num_computed, s.status, s.admitted = parent.num_computed, RUNNING, engine._admissions
        s.num_cached_tokens = parent.num_cached_tokens
        engine.running.append(s)
        tok = rows.token(row, s.generator, s.tokens, len(s.prompt))
        if s.append(tok, rows.logprobs(row, tok)):
            engine._retire(s)
        out = s.emit()
        if out is not None:
            outputs.append(out)


def release_siblings(engine, parent: Request) -> None:
    """The parent ended before its prompt was cached: its live siblings go to the front of the queue."""
    siblings, parent.siblings = parent.siblings, []
    for s in reversed(siblings):
        if not s.finished:
            engine.waiting.appendleft(s)
