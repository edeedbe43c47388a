"""Runs mutants, one at a time per slot, each on its own copy of the repository (the live tree is never
written): apply the mutant to the slot's file, fork a child that runs the mutant's pytest selection with -x
in that copy, wait (killing the child's process group past the timeout), restore the file.

The parent imports the heavy third-party modules once (torch, onnx, onnxruntime, transformers, triton, the
pytest plugins) and freezes them out of the garbage collector before forking, so a child pays only for
pagedkit's own modules and the tests (about 0.3 s of overhead instead of ~8 s for a fresh interpreter). The
parent never imports pagedkit: each child imports the slot's (mutated) copy. Bytecode is cached in the slot
copies; every write to a mutated file gets a fresh, strictly increasing mtime so that a cached .pyc of the
original can never stand in for a mutant (or the reverse).
"""

from __future__ import annotations

import builtins
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PRELOAD = ("numpy", "torch", "onnx", "onnx.reference", "onnx_ir", "onnxruntime", "ml_dtypes", "triton",
           "triton.language", "transformers", "transformers.modeling_utils", "safetensors", "tokenizers",
           "hypothesis", "starlette", "starlette.applications", "httpx", "uvicorn", "pytest")


@dataclass
class Outcome:
    status: str  # killed | survived | timeout | error (the unmutated selection failed, no tests, no mutation)
    seconds: float
    exit_code: int | None = None
    killed_by: str = ""  # the first FAILED / ERROR line of the run
    log_tail: str = ""


@dataclass
class Job:
    key: str
    path: str  # the mutated file, relative to the root ("" for a baseline run)
    text: str | None  # the file's mutated source
    tests: list[str]
    timeout: float
    extra: dict = field(default_factory=dict)


def repo_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: the working tree as it is, uncommitted edits included."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return [f for f in out.split("\0") if f and (root / f).is_file()]


def make_slots(root: Path, jobs: int, workdir: Path | None = None) -> list[Path]:
    base = Path(tempfile.mkdtemp(prefix="pagedkit-mutation-", dir=workdir))
    files = repo_files(root)
    slots = []
    for i in range(jobs):
        slot = base / f"slot{i}"
        for f in files:
            dst = slot / f
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / f, dst)
        slots.append(slot)
    return slots


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import the heavy third-party modules once, before any fork; never pagedkit."""
    import importlib.metadata

    cuda = False
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        pass
    if not cuda:  # tests/conftest.py does the same; set before any kernel module is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception:  # noqa: BLE001 - a component that needs it fails its baseline, naming it
            pass
    for ep in importlib.metadata.entry_points(group="pytest11"):
        try:
            importlib.import_module(ep.value.split(":")[0])
        except Exception:  # noqa: BLE001
            pass
    try:
        from cosmic_ray.exceptions import CosmicRayTestingException

        builtins.CosmicRayTestingException = CosmicRayTestingException  # what ExceptionReplacer writes
    except ImportError:
        pass
    assert not any(m == "pagedkit" or m.startswith("pagedkit.") for m in sys.modules), "preload imported pagedkit"
    gc.collect()
    gc.freeze()


def _child(slot: Path, tests: list[str], log: Path, threads: int) -> None:
    """In the forked child: run pytest on the slot copy; never returns."""
    code = 3
    try:
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(slot)
        sys.path[:0] = [str(slot)]
        os.environ["PYTHONPATH"] = os.pathsep.join([str(slot), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        sys.dont_write_bytecode = False
        try:
            import torch

            torch.set_num_threads(threads)
        except Exception:  # noqa: BLE001
            pass
        import pytest

        code = int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--no-header", "-W",
                                "ignore::pytest.PytestAssertRewriteWarning", f"--basetemp={slot / '.pytest-tmp'}",
                                *tests]))
        mod = sys.modules.get("pagedkit")
        if mod is not None and not Path(mod.__file__).resolve().is_relative_to(slot.resolve()):
            print(f"mutation: pagedkit was imported from {mod.__file__}, not the slot {slot}", flush=True)
            code = 99
    except BaseException as exc:  # noqa: BLE001
        print(f"mutation child: {type(exc).__name__}: {exc}", flush=True)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _first_failure(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for ln in lines:
        if ln.startswith(("FAILED ", "ERROR ")) or ln.startswith("mutation"):
            return ln[:300]
    for ln in reversed(lines):
        if ln.strip():
            return ln.strip()[:300]
    return ""


class Pool:
    def __init__(self, root: Path, jobs: int, workdir: Path | None = None, modules: tuple[str, ...] = PRELOAD):
        self.root = root
        self.jobs = jobs
        self.slots = make_slots(root, jobs, workdir)
        self.stamp = int(time.time()) + 10  # mtimes handed out, strictly increasing
        self.threads = max(1, (os.cpu_count() or 1) // jobs)
        preload(modules)

    def _write(self, slot: Path, rel: str, text: str) -> None:
        p = slot / rel
        p.write_text(text, encoding="utf-8")
        self.stamp += 2
        os.utime(p, (self.stamp, self.stamp))

    def run(self, jobs: list[Job], budget: float | None = None, progress=None) -> dict[str, Outcome]:
        """Run every job (a budget in seconds stops starting new ones); {job key: Outcome}."""
        pending = list(jobs)
        running: dict[int, tuple[int, Job, float, Path, str | None]] = {}  # slot -> (pid, job, t0, log, original)
        results: dict[str, Outcome] = {}
        start = time.monotonic()
        while pending or running:
            for i, slot in enumerate(self.slots):
                if i in running or not pending:
                    continue
                if budget is not None and time.monotonic() - start > budget:
                    pending.clear()
                    break
                job = pending.pop(0)
                original = None
                if job.path:
                    original = (slot / job.path).read_text(encoding="utf-8")
                    self._write(slot, job.path, job.text)
                log = slot / ".mutation.log"
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(slot, job.tests, log, self.threads)
                try:  # its own process group (the child does the same): a timeout kills all it started
                    os.setpgid(pid, pid)
                except OSError:
                    pass
                running[i] = (pid, job, time.monotonic(), log, original)
            time.sleep(0.02)
            for i, (pid, job, t0, log, original) in list(running.items()):
                elapsed = time.monotonic() - t0
                done, status = os.waitpid(pid, os.WNOHANG)
                if done == 0 and elapsed <= job.timeout:
                    continue
                if done == 0:  # past its timeout: the child and whatever it started
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    os.waitpid(pid, 0)
                    out = Outcome("timeout", elapsed, None, f"no result within {job.timeout:.0f} s")
                else:
                    try:  # a test's leftover processes in the child's group
                        os.killpg(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    code = os.waitstatus_to_exitcode(status)
                    if code == 0:
                        out = Outcome("survived", elapsed, 0)
                    elif code in (5, 99):
                        out = Outcome("error", elapsed, code, _first_failure(log) or "no tests collected")
                    else:  # 1: a test failed; 2-4: interrupted / collection or import error; <0: crashed
                        out = Outcome("killed", elapsed, code, _first_failure(log))
                if original is not None:
                    self._write(self.slots[i], job.path, original)
                if out.status != "survived":
                    out.log_tail = log.read_text(errors="replace")[-4000:] if log.exists() else ""
                results[job.key] = out
                del running[i]
                if progress:
                    progress(job, out, len(results), len(results) + len(running) + len(pending))
        return results

    def close(self) -> None:
        shutil.rmtree(self.slots[0].parent, ignore_errors=True)
