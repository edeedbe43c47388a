"""Continuous-batching generation over a paged model folder (model.onnx + genai_config.json).

    engine = Engine("model_dir", max_batch_size=8, max_num_tokens=256)
    rid = engine.add_request([1, 5, 9], SamplingParams(max_new_tokens=8))
    while engine.has_unfinished():
        for out in engine.step():            # one batch through the model per step
            print(out.request_id, out.new_token_ids, out.finish_reason)

Scheduling policy of one step (see docs/engine.md):
1. the inbox is drained: requests added / aborted from other threads since the last step;
2. running requests that decode get their one token (plus up to num_draft_tokens drafts), then
   running requests in the middle of a prefill get their next chunk, in admission order;
3. waiting requests are admitted in FIFO order (preempted ones first) while the batch has fewer than
   max_batch_size sequences, the step fewer than max_num_tokens tokens and the pool seems to hold the
   first chunk (a free-block watermark, always passed when nothing runs); each gets a prefill chunk
   of what the token budget leaves (chunked prefill across steps); every chunk is also cut to
   KVCacheManager.max_step_tokens (windowed rings, max_seq_len);
4. the batch is planned in one KVCacheManager plan. If the pool cannot hold it (KVCacheExhausted),
   requests admitted in this step go back to the front of the queue, latest first; then the most
   recently admitted running request is preempted (its blocks freed, it is requeued at the front with
   prompt + generated tokens as its new prefill: recompute); a request that cannot fit even alone ends
   with finish_reason "abort" and a reason;
5. the step runs; each sequence whose prompt is fully cached samples its next token (a request's token
   constraint, SamplingParams.constraint, first masks its logits: constraint.py; speculative
   entries verify their drafts: the longest matching prefix plus the target's own next token is kept,
   the rejected drafts are rolled back in the cache with KVCacheManager.accept).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

from ..runtime.kv.cache import KVCacheExhausted
from . import group as grp
from . import constraint
from .model import PREFILL_GRAPH_TOKENS, PagedModel
from .overlap import HostRing, Inflight, advance, greedy_decode
from .params import RequestOutput, SamplingParams
from .request import RUNNING, WAITING, Request, new_request
from .sampling import Choices
from .speculative import drafts_for, verify

log = logging.getLogger("pagedkit.engine")


@dataclass
class EngineStats:
    steps: int = 0  # steps that ran a batch
    tokens: int = 0  # tokens fed to the model (prefill + decode + drafts)
    preemptions: int = 0
    unadmitted: int = 0  # admissions undone within a step (the pool could not hold them)
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0  # tokens looked up in the prefix cache at admissions
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    max_batch: int = 0  # most sequences seen in one step
    graph_steps: int = 0  # decode steps CUDA graphs served (replays, and each graph's first, eager step)
    prefill_graph_steps: int = 0  # first-prompt steps prefill graphs served (replays and each key's first step)
    overlapped_steps: int = 0  # decode steps launched before the previous step's tokens were read (overlap)


@dataclass
class _Entry:
    req: Request
    ids: list[int]  # tokens fed this step: a prefill chunk, or [last token] + drafts
    drafts: int = 0
    new: bool = False  # admitted in this step


class Engine:
    """Continuous batching over one InferenceSession and one KVCacheManager (paged models only).

    max_batch_size: most sequences in one step; max_num_tokens: most tokens in one step (prefill chunks
    included); num_blocks: blocks of the full-attention pool (default: every one of max_batch_size
    sequences can reach the context length, within memory_fraction of what the device has free: None = 0.9 of
    the free GPU memory on CUDA, 0.25 of the available RAM on the CPU; model.py); block_size: None = the model's;
    enable_prefix_caching:
    reuse cached full blocks of identical prefixes (off for models with sliding-window layers); cuda_graphs:
    decode steps as CUDA-graph replays per batch bucket (graphs.py), None = on for CUDA; "padded" plans decode
    steps as the graphs do (batch buckets, replay-wide bounds) but runs them eagerly, on any device; overlap:
    greedy decode steps run one step ahead of the host (overlap.py: tokens come out one step() later), None =
    on with CUDA-graph replays; needs cuda_graphs (True or "padded"). tp: the model folder is a tensor-parallel
    export of tp ranks (`paged-export --tp N`; None: whatever the folder is): this process becomes rank 0 (scheduler,
    KV manager, sampling) of a set it starts (runtime/distributed), eager steps only; `close()` stops it.
    prefill_graph_tokens: steps of whole first prompts up to this many padded tokens (sequences x token bucket)
    run as CUDA-graph replays too, with cuda_graphs (prefill_graphs.py; "padded": the same padded steps
    eagerly); 0 = off. `model.prefill_graphs_off_reason` says why a model has none.
    add_request / abort may be called from any thread; step() from one thread at a time."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", *, max_batch_size: int = 16,
                 max_num_tokens: int = 512, num_blocks: int | None = None, block_size: int | None = None,
                 enable_prefix_caching: bool = True, cuda_graphs: bool | None = None,
                 overlap: bool | None = None, memory_fraction: float | None = None, tp: int | None = None,
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS):
        if overlap not in (None, True, False):
            raise ValueError(f"Engine: overlap must be None (on with CUDA graphs), True or False, got {overlap!r}")
        self.model = PagedModel(model_dir, device, max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                num_blocks=num_blocks, block_size=block_size,
                                enable_prefix_caching=enable_prefix_caching, cuda_graphs=cuda_graphs,
                                memory_fraction=memory_fraction, tp=tp, prefill_graph_tokens=prefill_graph_tokens)
        self.kv = self.model.mgr
        self.eos_token_ids: list[int] = list(self.model.config.eos_token_ids)
        self.vocab_size: int | None = self.model.config.vocab_size
        self.max_batch_size, self.max_num_tokens = max_batch_size, max_num_tokens
        self.stats = EngineStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self._admissions = 0
        self._lock = threading.Lock()  # guards _inbox and _live (touched by add_request / abort)
        self._step_lock = threading.Lock()
        self._inbox: list[tuple[str, object]] = []
        self._live: dict[str, Request] = {}  # unfinished requests by id (inbox included)
        graphs = self.model.graphs
        if overlap and graphs is None:
            raise ValueError("Engine: overlap=True needs cuda_graphs (True on CUDA, or 'padded'): overlapped "
                             "decode steps are the graphs' padded decode steps")
        self.overlap = bool(graphs is not None and graphs.capture) if overlap is None else overlap
        self._inflight: Inflight | None = None
        self._ring = HostRing(max_batch_size, self.kv.device) if self.overlap else None

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def max_pool_tokens(self) -> int:
        """The most tokens one request's cache can ever hold (prompt + max_new_tokens - 1 of them): the
        full-attention pool's blocks x block_size, at most max_seq_len (a request above is aborted, _never_fits)."""
        full = self.model.groups.get("full")
        return self.max_seq_len if full is None else min(self.max_seq_len, full.num_blocks * full.block_size)

    def close(self) -> None:
        """Stop the tensor-parallel followers of a tp > 1 engine (nothing to do otherwise)."""
        self.model.close()

    # ---- requests ----------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: str | None = None, drafter: Callable[[list[int]], list[int]] | None = None) -> str:
        """Queue a request (thread-safe); it is admitted at a later step(). Returns its id."""
        req = self._make_request(prompt_token_ids, params, request_id, drafter)
        self._enqueue([req])
        return req.request_id

    def add_group(self, prompt_token_ids: Sequence[int], params: Sequence[SamplingParams],
                  request_ids: Sequence[str] | None = None) -> list[str]:
        """Queue len(params) requests of one prompt (OpenAI's n) that share its prefill (group.py): the prompt
        runs once, then each request gets its blocks (KVCacheManager.fork) and its own tokens. The params are
        equal but for their seeds. Returns the ids, in order (thread-safe)."""
        params = list(params)
        grp.check_group(params, self.max_batch_size)
        ids = [None] * len(params) if request_ids is None else list(request_ids)
        if len(ids) != len(params):
            raise ValueError(f"add_group: expected {len(params)} request ids, got {len(ids)}")
        reqs = [self._make_request(prompt_token_ids, p, i, None) for p, i in zip(params, ids)]
        reqs[0].siblings = reqs[1:]
        self._enqueue(reqs, queued=1)
        return [r.request_id for r in reqs]

    def _make_request(self, prompt, params, request_id, drafter) -> Request:
        return new_request(prompt, params, request_id, drafter, vocab_size=self.vocab_size,
                           max_seq_len=self.max_seq_len, eos_token_ids=self.eos_token_ids)

    def _enqueue(self, reqs: list[Request], queued: int | None = None) -> None:
        """Register the requests; the first `queued` of them (all: None) go to the queue (add_group's siblings
        wait with their parent)."""
        with self._lock:
            ids = [r.request_id for r in reqs]
            dup = [i for i in ids if i in self._live] or [i for i in ids if ids.count(i) > 1]
            if dup:
                raise ValueError(f"request_id {dup[0]!r} is already in use by an unfinished request")
            for k, r in enumerate(reqs):
                self._live[r.request_id] = r
                if queued is None or k < queued:
                    self._inbox.append(("add", r))

    def abort(self, request_id: str) -> None:
        """Finish a request with "abort" at the next step (thread-safe); its blocks go back to the pool.
        A finished or unknown request id is left alone (a client may abort after the end)."""
        with self._lock:
            if request_id in self._live:
                self._inbox.append(("abort", request_id))

    def has_unfinished(self) -> bool:
        with self._lock:
            return bool(self._live)

    # ---- stepping ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine iteration: at most one batch through the model. Returns an output for every
        request that changed (new visible tokens, or finished)."""
        if not self._step_lock.acquire(blocking=False):
            raise RuntimeError("Engine.step() is already running in another thread; call it from one thread")
        try:
            outputs = self._drain()
            if self._inflight is not None:
                outputs += advance(self, lambda r, ids: _Entry(r, ids))
                if self._inflight is not None:  # the next step is in flight already
                    return outputs
            entries = self._schedule(outputs)
            plan = self._plan(entries, outputs)
            if plan is not None:
                if self.overlap and all(greedy_decode(e) for e in entries) and self.model.graphs.serves(plan):
                    self._launch(entries, plan, None)
                else:
                    outputs += self._execute(entries, plan)
            return outputs
        finally:
            self._step_lock.release()

    def _drain(self) -> list[RequestOutput]:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        outputs = []
        for kind, item in inbox:
            if kind == "add":
                why = self._never_fits(item)
                if why is None:
                    self.waiting.append(item)
                    continue
                for r in [item] + [s for s in item.siblings if not s.finished]:  # a group never fits alike
                    r.finish("abort", why)
                    if r is not item:
                        self._retire(r)
                        outputs.append(r.emit())
                log.warning("request %s aborted: %s", item.request_id, why)
            else:
                with self._lock:
                    item = self._live.get(item)
                if item is None or item.finished:
                    continue
                item.finish("abort", "aborted by Engine.abort")
            self._retire(item)
            outputs.append(item.emit())
        return outputs

    def _never_fits(self, req: Request) -> str | None:
        longest = min(len(req.prompt) + req.params.max_new_tokens - 1, self.max_seq_len)
        for group, need in self.model.blocks_needed(longest).items():
            have = self.kv.config.group(group).num_blocks
            if need > have:
                return (f"the KV cache can never hold this request: {longest} tokens (prompt {len(req.prompt)} + "
                        f"max_new_tokens {req.params.max_new_tokens} - 1) need {need} blocks of group {group!r}, "
                        f"the pool has {have} (raise num_blocks or lower max_new_tokens)")
        return None

    def _schedule(self, outputs: list[RequestOutput]) -> list[_Entry]:
        entries: list[_Entry] = []
        budget = self.max_num_tokens
        ordered = [r for r in self.running if r.decoding] + [r for r in self.running if not r.decoding]
        for r in ordered:
            if len(entries) >= self.max_batch_size or budget < 1:
                break
            room = min(budget, self.kv.max_step_tokens(r.request_id))
            if r.decoding:
                try:
                    drafts = drafts_for(r, room - 1, self.vocab_size) if not r.siblings else []
                except Exception as exc:  # a request's own drafter failed: that request ends, not the batch
                    r.finish("abort", f"the request's drafter failed: {type(exc).__name__}: {exc}"[:500])
                    log.warning("request %s aborted: %s", r.request_id, r.reason)
                    self._retire(r)
                    outputs.append(r.emit())
                    continue
                entries.append(_Entry(r, [r.tokens[-1]] + drafts, len(drafts)))
            else:
                entries.append(_Entry(r, r.tokens[r.num_computed:r.num_computed + room]))
            budget -= len(entries[-1].ids)
        # admission watermark: a waiting request is admitted while the full-attention pool seems to hold its
        # first chunk on top of this step's growth of the running ones (a heuristic: prefix hits are not
        # counted; _plan's retry is the exact check). With nothing running, the head is always admitted.
        full = "full" in self.model.groups
        spare = self.kv.num_free_blocks("full") - sum(self._new_blocks(e) for e in entries) if full else 0
        # a group's parent is admitted when the batch has room for its siblings too (they fork off its prompt)
        reserved = sum(grp.pending(r) for r in self.running)
        while self.waiting and len(entries) + reserved < self.max_batch_size and budget >= 1:
            need = -(-min(budget, len(self.waiting[0].tokens)) // self.model.block_size)
            if full and self.running and need > spare:
                break
            group = grp.pending(self.waiting[0])
            if group and self.running and len(entries) + reserved + 1 + group > self.max_batch_size:
                break
            spare -= need
            reserved += group
            r = self.waiting.popleft()
            hit = self.kv.add_sequence(r.request_id, r.tokens)
            self.stats.prefix_hit_tokens += hit
            self.stats.prefix_query_tokens += len(r.tokens)
            if r.num_cached_tokens is None:
                r.num_cached_tokens = min(hit, len(r.prompt))
            self._admissions += 1
            r.num_computed, r.status, r.admitted = hit, RUNNING, self._admissions
            self.running.append(r)
            room = min(budget, self.kv.max_step_tokens(r.request_id))
            entries.append(_Entry(r, r.tokens[hit:hit + room], new=True))
            budget -= len(entries[-1].ids)
        return entries

    def _new_blocks(self, e: _Entry) -> int:
        """Full-attention blocks a running entry's step allocates (its cached length grows by len(ids))."""
        bs, length = self.model.block_size, self.kv.length(e.req.request_id)
        return -(-(length + len(e.ids)) // bs) - -(-length // bs)

    def _plan(self, entries: list[_Entry], outputs: list[RequestOutput]):
        """One KVCacheManager plan for the batch, preempting (or, alone, aborting) on exhaustion."""
        while entries:
            for e in entries:
                if e.drafts:
                    self.kv.speculate(e.req.request_id, e.drafts)
            try:
                return self.model.plan([(e.req.request_id, e.ids) for e in entries])
            except KVCacheExhausted as exc:
                newly = [e for e in entries if e.new]
                if newly:
                    victim = newly[-1].req
                    self._requeue(victim)
                    self.stats.unadmitted += 1
                elif len(self.running) > 1:
                    victim = max(self.running, key=lambda r: r.admitted)
                    self._requeue(victim)
                    victim.num_preemptions += 1
                    self.stats.preemptions += 1
                    log.info("preempted request %s (recompute of %d tokens)", victim.request_id, len(victim.tokens))
                else:
                    victim = entries[0].req
                    victim.finish("abort", f"the KV cache cannot hold this request even alone: {exc}")
                    log.warning("request %s aborted: %s", victim.request_id, victim.reason)
                    self._retire(victim)
                    outputs.append(victim.emit())
                entries[:] = [e for e in entries if e.req is not victim]
        return None

    def _requeue(self, r: Request) -> None:
        """Free the request's blocks and put it at the front of the queue: its next prefill is prompt +
        generated tokens (nothing is emitted again: num_emitted stays)."""
        self.kv.free(r.request_id)
        self.running.remove(r)
        r.status, r.num_computed, r.admitted = WAITING, 0, -1
        self.waiting.appendleft(r)

    def _launch(self, entries: list[_Entry], plan, device_ids) -> Inflight:
        """Run a greedy decode step and leave it in flight (overlap.py). Known ids (device_ids None): the plan
        is committed now; device ids (the previous step's choices): the caller sets them and commits."""
        ids = [e.ids[0] for e in entries]
        logits = self.model.run(plan, ids, None, device_ids)
        if device_ids is None:
            self.kv.commit(plan)
        flight = self._ring.launch(entries, plan, logits)
        self._count(entries, True)
        self.stats.overlapped_steps += int(device_ids is not None)
        if device_ids is None:
            self._inflight = flight
        return flight

    def _count(self, entries: list[_Entry], graphed: bool) -> None:
        self.stats.steps += 1
        self.stats.graph_steps += int(graphed)
        self.stats.tokens += sum(len(e.ids) for e in entries)
        self.stats.max_batch = max(self.stats.max_batch, len(entries))

    def _check_length(self, r: Request, expected: int) -> None:
        if self.kv.length(r.request_id) != expected:
            raise RuntimeError(f"request {r.request_id}: the cache holds {self.kv.length(r.request_id)} tokens, "
                               f"the engine counts {expected}")

    def _execute(self, entries: list[_Entry], plan) -> list[RequestOutput]:
        ids = [t for e in entries for t in e.ids]
        wanted, starts, flat = [], [], 0  # the flat positions whose logits are sampled, per entry
        params = []  # the sampling params of each sampled row
        picks = []  # (request, first row, drafts) of the entries that sample (their token constraints' masks)
        for e in entries:
            starts.append(len(wanted))
            n = len(e.ids)
            if e.drafts:
                picks.append((e.req, len(wanted), e.ids[1:]))
                wanted += range(flat, flat + n)  # every position verifies a draft or gives the next token
                params += [e.req.params] * n
            elif e.req.num_computed + n == len(e.req.tokens):
                picks.append((e.req, len(wanted), []))
                wanted.append(flat + n - 1)  # the prompt (+ generated) is now all cached: sample
                params.append(e.req.params)
            flat += n
        graphed = self.model.graphs is not None and self.model.graphs.serves(plan)
        pg = self.model.prefill_graphs
        self.stats.prefill_graph_steps += int(pg is not None and pg.serves(plan))
        logits = self.model.run(plan, ids, wanted)
        self.kv.commit(plan)  # host bookkeeping while the device runs the step
        masks, failed = constraint.step_masks(picks, logits.shape[-1])  # token constraints: host work, no device read
        logits = constraint.apply(logits, masks)
        rows = Choices(logits, params)  # greedy rows: one argmax on the device, one small copy (waits for it)
        self._count(entries, graphed)
        outputs = []
        for e, start in zip(entries, starts):
            r, n = e.req, len(e.ids)
            if id(r) in failed:
                r.finish("abort", failed[id(r)])
                log.warning("request %s aborted: %s", r.request_id, r.reason)
            elif e.drafts:
                toks = verify(e, rows, start)
                accepted = len(toks) - 1
                self.kv.accept(r.request_id, accepted)
                r.num_computed += 1 + accepted
                self.stats.draft_tokens += e.drafts
                self.stats.accepted_draft_tokens += accepted
            else:
                r.num_computed += n
                toks = [rows.token(start, r.generator, r.tokens, len(r.prompt))] if r.num_computed == len(r.tokens) else []
            if not r.finished:
                self._check_length(r, r.num_computed)
                for k, t in enumerate(toks):
                    if r.append(t, rows.logprobs(start + k, t)):
                        break
                if r.siblings and toks:
                    grp.fork_siblings(self, r, rows, start, outputs)
            if r.finished:
                self._retire(r)
            out = r.emit()
            if out is not None:
                outputs.append(out)
        return outputs

    def _retire(self, r: Request) -> None:
        """Drop a finished request (every caller has called r.finish, so its status is already FINISHED)
        from the running list (its blocks freed) or the queue, and from the live ids."""
        if r in self.running:
            self.kv.free(r.request_id)
            self.running.remove(r)
        elif r in self.waiting:
            self.waiting.remove(r)
        if r.siblings:  # a group's parent that ended before its prompt was cached
            grp.release_siblings(self, r)
        with self._lock:
            self._live.pop(r.request_id, None)

    # ---- conveniences ------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; their final outputs in input order. Other requests in the
        engine progress meanwhile, but their outputs of these steps are not returned."""
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise ValueError(f"params: expected one SamplingParams per prompt ({len(prompts)}), got {len(params)}")
            per = list(params)
        else:
            per = [params] * len(prompts)
        reqs = [self._make_request(p, sp, None, None) for p, sp in zip(prompts, per)]
        self._enqueue(reqs)
        final: dict[str, RequestOutput] = {}
        pending = {r.request_id for r in reqs}
        while pending:
            outs = self.step()
            for o in outs:
                if o.finished and o.request_id in pending:
                    final[o.request_id] = o
                    pending.discard(o.request_id)
            if pending and not outs and not self.running and not self.waiting:
                raise RuntimeError(f"Engine.generate: requests {sorted(pending)} make no progress")
        return [final[r.request_id] for r in reqs]

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
               drafter: Callable[[list[int]], list[int]] | None = None) -> Iterator[RequestOutput]:
        """One request's outputs as they come (this iterator drives step()); closing it early aborts it."""
        rid = self.add_request(prompt_token_ids, params, drafter=drafter)
        done = False
        try:
            while not done:
                for o in self.step():
                    if o.request_id == rid:
                        done = o.finished
                        yield o
        finally:
            if not done:
                self.abort(rid)

    # ---- introspection -----------------------------------------------------------------------------
    def num_free_blocks(self) -> dict[str, int]:
        """Free (unused + evictable prefix-cached) blocks per KV group."""
        return {g: self.kv.num_free_blocks(g) for g in self.model.groups}

    def num_blocks(self) -> dict[str, int]:
        return {g: c.num_blocks for g, c in self.model.groups.items()}

    def check_invariants(self) -> list[str]:
        errs = self.kv.check_invariants()
        held = set(self.kv.seqs)
        mine = {r.request_id for r in self.running}
        if held != mine:
            errs.append(f"the cache holds sequences {sorted(map(str, held))}, the engine runs {sorted(mine)}")
        return errs
