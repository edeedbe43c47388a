"""The engine's worker thread: loops `engine.step()` while requests are pending, sleeps on an event when
idle, and hands each RequestOutput to the asyncio queue of its request (`loop.call_soon_threadsafe`).

`submit` registers the request's queue under a request id chosen here before the engine sees the request,
so no output can arrive for an unknown id. An output with `finished` set unregisters the request; `abort`
(a client that went away, a stop string found by the server) aborts it in the engine and drops its queue,
so later outputs of that id are ignored. An exception raised by `engine.step()` (or `has_unfinished()`)
marks the worker failed: it is logged once with its traceback, put on every pending request's queue (each
of them fails with it, once), those requests are aborted and the thread ends; `failure` then says why,
/health answers 503 and `submit` raises EngineDown (an engine whose step failed is not trusted again:
restart the server).
`submit_group` queues the n choices of one prompt together (`engine.add_group`: one prefill). A `metrics`
object (metrics.ServeMetrics) sees each submission, each step's outputs and the engine after each step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid

log = logging.getLogger("uvicorn.error")


class EngineDown(RuntimeError):
    """The engine failed earlier: the worker takes no more requests."""


class EngineWorker:
    def __init__(self, engine, idle_wait_s: float = 0.5, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._idle_wait_s = idle_wait_s
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self.failure: BaseException | None = None  # what made the engine fail (then nothing more is run)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self.failure is not None or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="paged-serve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- requests (called from the event loop) ---------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params, arrival: float | None = None) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns (request id, the asyncio queue its RequestOutputs arrive on). arrival: when
        the HTTP request came (time.monotonic(); the metrics' time to first token starts there)."""
        return self._submit(prompt_token_ids, [params], arrival, lambda ids, p: self.engine.add_request(
            list(prompt_token_ids), p[0], request_id=ids[0]))[0]

    def submit_group(self, prompt_token_ids: list[int], params: list, arrival: float | None = None
                     ) -> list[tuple[str, asyncio.Queue]]:
        """Queue the choices of one prompt as one engine group (engine.add_group: the prompt prefilled once);
        ValueError when the engine has no add_group or refuses the group."""
        add_group = getattr(self.engine, "add_group", None)
        if add_group is None:
            raise ValueError("this engine runs one choice per request (no add_group): n must be 1")
        return self._submit(prompt_token_ids, params, arrival,
                            lambda ids, p: add_group(list(prompt_token_ids), p, request_ids=ids))

    def _submit(self, prompt_token_ids, params: list, arrival, add) -> list[tuple[str, asyncio.Queue]]:
        self.start()
        loop = asyncio.get_running_loop()
        out = [(f"{self._prefix}-{next(self._ids)}", asyncio.Queue()) for _ in params]
        ids = [rid for rid, _ in out]
        with self._lock:  # the failure is set under this lock: no queue registers after the last one failed
            if self.failure is not None:
                raise EngineDown(f"the engine failed earlier ({type(self.failure).__name__}: {self.failure}); "
                                 "restart the server")
            for rid, queue in out:
                self._queues[rid] = (loop, queue)
        if self.metrics is not None:  # before the engine may emit anything for them
            self.metrics.submitted(ids, len(prompt_token_ids), arrival)
        try:
            add(ids, params)
        except BaseException:
            with self._lock:
                for rid in ids:
                    self._queues.pop(rid, None)
            if self.metrics is not None:
                self.metrics.observe([], forget=ids)
            raise
        self._wake.set()
        return out

    def abort(self, request_id: str) -> None:
        """Stop a request (idempotent): the engine frees it, its queue gets nothing more."""
        with self._lock:
            known = self._queues.pop(request_id, None) is not None
        if known:
            self.engine.abort(request_id)
            self._wake.set()

    def pending(self) -> int:
        with self._lock:
            return len(self._queues)

    # -- the thread ------------------------------------------------------------------------------
    @staticmethod
    def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server shutting down): nobody listens
            pass

    def _dispatch(self, outputs) -> None:
        with self._lock:  # once a step, not once an output
            targets = [(self._queues.pop(out.request_id, None) if out.finished else self._queues.get(out.request_id),
                        out) for out in outputs]
        for target, out in targets:
            if target is not None:
                self._put(*target, out)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            self.failure = exc
            failed, self._queues = self._queues, {}
        log.error("the engine failed (%d requests in flight fail with it; /health reports 503 from now on)",
                  len(failed), exc_info=exc)
        for request_id, target in failed.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine is already in trouble: the request fails either way
                pass
            self._put(*target, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                busy = self.engine.has_unfinished()
            except Exception as exc:
                self._fail_all(exc)
                return
            if not busy:
                self._wake.wait(self._idle_wait_s)
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:
                self._fail_all(exc)
                return
            self._dispatch(outputs)
            if self.metrics is not None:
                now = time.monotonic()
                self.metrics.observe(outputs, now)
                self.metrics.after_step(self.engine)
