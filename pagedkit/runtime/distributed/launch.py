"""A tensor-parallel set on this machine: this process is rank 0, N - 1 followers are spawned (one per device).

    with TensorParallel(2) as tp:                       # CPU: 2 processes on gloo; device="cuda": NCCL, GPU r
        session = tp.session("out_tp2")                 # every rank loads its rank_<r>/model.onnx
        gen = Generator("out_tp2", session=session)     # rank 0 plans; each step's inputs go to every rank
        ...

Rank 0 owns everything above the session (scheduler, KV manager, tokenizer, HTTP server): `DistributedSession`
(session.py) broadcasts each step's inputs (the plan: token ids, block tables, lengths, ...) before running its own
shard, and the followers run the same step on theirs (follower.py). The set is bounded in time: every collective
has the timeout (PAGEDKIT_TP_TIMEOUT, default 300 s); a rank that dies stops the set at once. Any failure of a
step ends the set (`TPError`, one line naming the rank and why) and the remaining followers are stopped: the
ranks can no longer agree on their caches. `close()` (or the end of the `with`) stops the followers.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
import weakref
from pathlib import Path

import torch

from . import group as G
from . import messages as M
from .folder import TP_KEY, rank_model_path, resolve_world, tp_section, world_size_of  # noqa: F401 (re-exported)
from .group import TPError

START_TIMEOUT = 120.0  # seconds a follower may take to start (imports), at least; it failing is seen at once
LOAD_TIMEOUT = 1800.0  # seconds a follower may take to load its graph (a large shard), at least; likewise


def _stop(procs, tmp) -> None:
    procs = [p for p in procs if p._popen is not None]  # started
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():  # a stopped or stuck process
            p.kill()
            p.join(5)
    shutil.rmtree(tmp, ignore_errors=True)


class TensorParallel:
    """N ranks on this machine; this process is rank 0 (module docstring). device "cpu": gloo, N processes;
    "cuda": NCCL, rank r on GPU r. timeout: seconds of every collective (None: PAGEDKIT_TP_TIMEOUT). threads:
    CPU threads of each follower (None: the cores divided among the ranks)."""

    def __init__(self, world_size: int, device: str = "cpu", *, timeout: float | None = None,
                 threads: int | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"tensor parallel: expected a world size >= 2, got {world_size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"tensor parallel: device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"--tp {world_size} on cuda needs {world_size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        self.world, self.device = world_size, device
        self.timeout = G.timeout_seconds(timeout)
        threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self._tmp = tempfile.mkdtemp(prefix="pagedkit-tp-")
        store_path = os.path.join(self._tmp, "store")
        ctx = torch.multiprocessing.get_context("spawn")
        from .follower import main

        self.procs = [ctx.Process(target=main, args=(r, world_size, store_path, device, self.timeout, threads),
                                  name=f"pagedkit-tp-rank{r}", daemon=True) for r in range(1, world_size)]
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._tmp)
        self._sessions = 0
        self.broken: str | None = None
        for p in self.procs:
            p.start()
        try:
            self._wait_ready(store_path)
            dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
            self.group = G.init(0, world_size, store_path, dev, self.timeout)
        except BaseException:
            self._finalizer()
            raise

    def _wait_ready(self, store_path: str) -> None:
        """Wait for every follower to have started (imports done), failing at once if one exits."""
        import datetime

        import torch.distributed as dist

        store = dist.FileStore(store_path, self.world)
        store.set_timeout(datetime.timedelta(seconds=1))
        start = max(self.timeout, START_TIMEOUT)  # importing torch on a busy machine is slow, and no collective
        deadline = time.monotonic() + start
        for r, p in enumerate(self.procs, 1):
            while True:
                try:
                    store.wait([f"ready/{r}"])
                    break
                except Exception:  # not yet: the follower is still importing
                    if not p.is_alive():
                        raise TPError(f"tensor-parallel rank {r} exited while starting ({self._how(p)})") from None
                    if time.monotonic() > deadline:
                        raise TPError(f"tensor-parallel rank {r} did not start within {start:g} s") from None

    # ---- sessions -------------------------------------------------------------------------------------------
    def session(self, folder: str | os.PathLike, *, threads: int | None = None, **options):
        """Every rank's InferenceSession over its graph of `folder` (a tensor-parallel export of this set's world
        size); returns rank 0's, as a DistributedSession. options: InferenceSession's keyword arguments
        (cpu_backend, allow_reference_fallback, capturable, validate_inputs)."""
        from ..session import InferenceSession, SessionOptions
        from .session import DistributedSession

        self._check()
        path = rank_model_path(folder, 0, self.world)
        self._sessions += 1
        sid = self._sessions
        providers = ["CUDAExecutionProvider"] if self.device == "cuda" else ["CPUExecutionProvider"]
        opts = dict(options, providers=providers)
        self.send(M.LOAD, {"sid": sid, "folder": str(Path(folder).resolve()), "options": dict(opts, threads=threads)})
        error = None
        try:
            local = InferenceSession(str(path), SessionOptions(intra_op_num_threads=threads) if threads else None,
                                     **opts)
        except Exception as exc:
            error, local = exc, None
        failed = [(r, s) for r, s in self._statuses(f"status/{sid}") if s != "ok"]
        if error is not None:
            raise error
        if failed:
            r, why = failed[0]
            raise ValueError(f"tensor-parallel rank {r} could not load {folder}: {why}")
        return DistributedSession(self, sid, local)

    def _statuses(self, prefix: str) -> list[tuple[int, str]]:
        """Each follower's answer under `prefix/<rank>` in the store (waiting while it works, failing at once if it
        dies, at most LOAD_TIMEOUT seconds)."""
        out, deadline = [], time.monotonic() + max(self.timeout, LOAD_TIMEOUT)
        for r, p in enumerate(self.procs, 1):
            key = f"{prefix}/{r}"
            while not self.group.store.check([key]):
                if not p.is_alive() or time.monotonic() > deadline:
                    self.guard(lambda: (_ for _ in ()).throw(TPError(f"no answer from rank {r}")))
                time.sleep(0.01)
            out.append((r, self.group.store.get(key).decode()))
        return out

    # ---- messages and failures -----------------------------------------------------------------------------
    def send(self, kind: int, meta: dict, tensors=()) -> None:
        self._check()
        self.guard(lambda: M.send(self.group.control, kind, meta, list(tensors), self.timeout))

    def guard(self, fn):
        """fn() on rank 0; any failure ends the set with one TPError line naming the rank and why."""
        self._check()
        try:
            return fn()
        except BaseException as exc:
            why = self._diagnose(exc)
            self.broken = why
            self._finalizer()
            G.close()
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise TPError(why) from exc

    def _how(self, p) -> str:
        code = p.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def _diagnose(self, exc: BaseException) -> str:
        """One line: which rank ended the set and why (a follower's own error line when it wrote one)."""
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and all(p.is_alive() for p in self.procs):
            time.sleep(0.05)  # a peer's death is seen by the collective a moment before its exit status
        for r, p in enumerate(self.procs, 1):
            if not p.is_alive():
                said = ""
                try:
                    if self.group.store.check([f"error/{r}"]):
                        said = ": " + self.group.store.get(f"error/{r}").decode()
                except Exception:
                    pass
                return f"tensor-parallel rank {r} of {self.world} stopped ({self._how(p)}){said}; the run stops"
        text = " ".join(str(exc).split()) or type(exc).__name__
        if "timed out" in text.lower() or "timeout" in text.lower():
            return (f"tensor-parallel set of {self.world}: no answer from a rank within the {self.timeout:g} s "
                    f"collective timeout ({text[:200]}); the run stops")
        return f"tensor-parallel rank 0 of {self.world}: {type(exc).__name__}: {text[:300]}; the run stops"

    def _check(self) -> None:
        if self.broken:
            raise TPError(f"the tensor-parallel set has stopped: {self.broken}")
        if not self._finalizer.alive:
            raise TPError("the tensor-parallel set is closed")

    # ---- life ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the followers (STOP message, then wait) and leave the set."""
        if self._finalizer.alive and not self.broken:
            try:
                M.send(self.group.control, M.STOP, {}, timeout=self.timeout)
                for p in self.procs:
                    p.join(self.timeout)
            except Exception:
                pass
        self._finalizer()
        G.close()

    def __enter__(self) -> "TensorParallel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
