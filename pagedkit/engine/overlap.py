"""Overlapped decode: the engine runs its decode steps one step ahead of the host.

A synchronous step waits for its own tokens before the host plans the next one, so the device idles while
the host plans, and the host idles while the device runs. With overlap, a greedy decode step that CUDA graphs
serve is launched and left in flight (`Inflight`): its choices are taken on the device ([B] int64 argmax)
and copied to pinned host memory without waiting. At the next `Engine.step()`, when the batch can only be
the same requests decoding one more token (`chain_entries`), the following step is planned and launched
first, its input ids copied on the device from the in-flight step's choices; only then does the host wait
for the in-flight step's tokens, which by now have long arrived, and process them (stop rules, streaming).
The host's planning and bookkeeping of one step thus run while the device runs the next.

What is new in the host's view: tokens come out one `step()` later than they were computed; a request
that a token ends (a stop token or stop sequence) has already had one more step launched for it, whose
choice is dropped (its cache row is freed with the request). A step's token ids are known to the
KVCacheManager only after the step was planned: it is planned with placeholders and the ids are set
(`KVCacheManager.set_tokens`) before it is committed, so prefix-cache hashes see the real ids.

Anything else (admissions, prefill chunks, sampling at temperature > 0, drafts, token constraints, preemption,
a request that a length limit ends) makes the engine wait for the in-flight step and run the classic synchronous step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..runtime.kv.cache import KVCacheExhausted
from ..runtime.kv.staging import PinnedRing
from .logits import needs_host
from .sampling import greedy_rows

PLACEHOLDER = 0  # the id a step is planned with before its real id is known (set before commit)


@dataclass
class Inflight:
    """A launched decode step whose tokens the host has not read: entries (the engine's _Entry list, one
    token each), its committed plan, the choices on the device and their pinned host copy."""

    entries: list
    plan: object
    choices: torch.Tensor  # [B] int64 on the run device
    host: torch.Tensor  # [B] int64, pinned on CUDA
    event: object | None  # torch.cuda.Event recorded after the copy (None: the copy was synchronous)

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class HostRing:
    """The choices' device -> host copies through a PinnedRing of [max_batch] int64 buffers (at most two
    steps are in flight; a buffer is taken again only after its step was read)."""

    def __init__(self, size: int, device: torch.device):
        self.ring = PinnedRing.of(size, torch.int64, device.type == "cuda")

    def launch(self, entries: list, plan, logits: torch.Tensor) -> Inflight:
        """The in-flight record of a launched step: greedy choices of logits [B, V] on the device, copied."""
        choices = greedy_rows(logits)
        host = self.ring.take()[: choices.shape[0]]
        host.copy_(choices, non_blocking=self.ring.cuda)
        return Inflight(entries, plan, choices, host, self.ring.done())


def greedy_decode(e) -> bool:
    """An entry (engine._Entry) whose step overlap may run ahead: one token, no drafts, greedy."""
    r = e.req
    return (len(e.ids) == 1 and not e.drafts and not e.new and r.decoding and not needs_host(r.params)
            and r.params.num_draft_tokens == 0 and r.constraint is None and not r.siblings)


def chain_entries(engine, prev: Inflight, make_entry) -> list | None:
    """The entries of the step that may be launched before `prev`'s tokens are read: the same running
    requests, each decoding one more token; None when the next step may differ (module docstring)."""
    running = engine.running
    if engine.waiting or len(running) != len(prev.entries):
        return None
    mgr = engine.kv
    ids = {id(e.req) for e in prev.entries}
    out = []
    for r in running:
        if (id(r) not in ids or r.finished or needs_host(r.params) or r.params.num_draft_tokens
                or r.constraint is not None):  # a token constraint's mask needs the previous token
            return None
        # prev's token must not end the request by length, and the next token must fit the context
        if r.num_output + 1 >= r.params.max_new_tokens or len(r.tokens) + 2 > r.max_total:
            return None
        if mgr.length(r.request_id) + 1 > mgr.config.max_seq_len:
            return None
        out.append(make_entry(r, [PLACEHOLDER]))
    return out  # whether CUDA graphs serve the step: its plan says (advance)


def advance(engine, make_entry) -> list:
    """Engine.step() with a step in flight: launch the next one first when it can only be the same decode
    batch (chain_entries), then read the in-flight step's tokens, set them as the new step's ids (commit),
    and process them (stop rules, streaming); the outputs of the read step."""
    prev, nxt = engine._inflight, None
    engine._inflight = None
    mgr = engine.kv
    try:
        entries = chain_entries(engine, prev, make_entry)
        if entries is not None:
            try:
                plan = engine.model.plan([(e.req.request_id, e.ids) for e in entries])
            except KVCacheExhausted:  # the classic step preempts (after the in-flight step is read)
                plan = None
            if plan is not None and not engine.model.graphs.serves(plan):  # device ids need a graph step
                mgr.abort(plan)
                plan = None
            if plan is not None:
                nxt = engine._launch(entries, plan, prev.choices)
    except BaseException:
        engine._inflight = prev
        raise
    tokens = prev.tokens()
    if nxt is not None:
        order = {id(e.req): k for k, e in enumerate(prev.entries)}
        for e in nxt.entries:
            t = tokens[order[id(e.req)]]
            e.ids[0] = t
            mgr.set_tokens(e.req.request_id, mgr.length(e.req.request_id), [t])  # the position nxt feeds
        mgr.commit(nxt.plan)
        engine._inflight = nxt
    ahead = {id(e.req) for e in nxt.entries} if nxt is not None else set()
    outputs = []
    for e, t in zip(prev.entries, tokens):
        r = e.req
        if r.finished:  # aborted while in flight, or ended by the step before (its choice is dropped)
            continue
        r.num_computed += 1
        engine._check_length(r, r.num_computed + (id(r) in ahead))
        if r.append(t):
            engine._retire(r)
        out = r.emit()
        if out is not None:
            outputs.append(out)
    return outputs
