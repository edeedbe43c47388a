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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid

log = logging.getLogger("uvicorn.error")


class EngineDown(RuntimeError):
    """The engine failed earlier: the worker takes no more requests."""


class EngineWorker:
    def __init__(self, engine, idle_wait_s: float = 0.5):
        self.engine = engine
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
    def submit(self, prompt_token_ids: list[int], params) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns (request id, the asyncio queue its RequestOutputs arrive on)."""
        self.start()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        request_id = f"{self._prefix}-{next(self._ids)}"
        with self._lock:  # the failure is set under this lock: no queue registers after the last one failed
            if self.failure is not None:
                raise EngineDown(f"the engine failed earlier ({type(self.failure).__name__}: {self.failure}); "
                                 "restart the server")
            self._queues[request_id] = (loop, queue)
        try:
            self.engine.add_request(list(prompt_token_ids), params, request_id=request_id)
        except BaseException:
            with self._lock:
                self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return request_id, queue

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
