"""The CPU plan of a model folder on disk: the one onnxruntime model that runtime/delegate.py makes of it (every
PagedAttention node a pagedkit.cpu node, float16 weights widened, the LM head for chosen rows) and what running it
needs (`plan.json`). Torch-free: the runner (runtime/lite/runner.py) reads it in a process that never imports torch;
a missing plan is made by runtime/lite/make.py (in a child process, `python -m pagedkit.runtime.lite.compile`, which
does import torch, unless the caller has imported torch already).

Where: `<model folder>/.pagedkit/cpu/<key>/` when the folder is writable (weights widened to float32 go to
`segment.data` there, memory-mapped by onnxruntime as the folder's other external data), else
`$PAGEDKIT_CACHE/cpu_plans/<key>/` (widened weights inline). The key is a digest of everything the plan depends on:
the model folder's files (names, sizes, modification times: genai_config.json's among them), the thread count (the
attention nodes' attribute), onnxruntime's version, pagedkit's source (the delegation and the kernel) and
PLAN_VERSION: any change makes a new plan, never a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ... import settings

PLAN_VERSION = 1
PLAN_FILE = "plan.json"
SEGMENT_FILE = "segment.onnx"
DATA_FILE = "segment.data"
IN_FOLDER = Path(".pagedkit") / "cpu"  # under the model folder
_SOURCE_DIGEST: str | None = None


class LiteUnavailable(RuntimeError):
    """The model cannot run on the torch-free CPU path; the message says why (the torch path serves it)."""


def _source_digest() -> str:
    """A digest of pagedkit's source (.py, .c, .h), computed once per process."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.sha256()
        root = Path(__file__).resolve().parents[2]
        for p in sorted(root.rglob("*")):
            if p.suffix in (".py", ".c", ".h") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def plan_key(folder: str | os.PathLike, threads: int) -> str:
    """The key of a folder's plan at `threads` (see the module doc)."""
    import onnxruntime

    folder = Path(folder).resolve()
    h = hashlib.sha256(f"v{PLAN_VERSION}\0{threads}\0{onnxruntime.__version__}\0{_source_digest()}\0".encode())
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or not p.is_file():
            continue
        st = p.stat()
        h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:24]


def writable(folder: Path) -> bool:
    """Whether plans may go under the folder: .pagedkit/cpu creatable there, writable, and no link leading out."""
    top = folder / IN_FOLDER.parts[0]
    if top.is_symlink() or (top / IN_FOLDER.parts[1]).is_symlink():
        return False
    try:
        (folder / IN_FOLDER).mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return (folder / IN_FOLDER).resolve().is_relative_to(folder) and os.access(folder / IN_FOLDER, os.W_OK)


def plan_dirs(folder: str | os.PathLike, threads: int) -> list[Path]:
    """Where the plan may lie, in the order looked at: under the model folder, then under $PAGEDKIT_CACHE."""
    folder, key = Path(folder).resolve(), plan_key(folder, threads)
    return [folder / IN_FOLDER / key, Path(settings.read("PAGEDKIT_CACHE")).expanduser() / "cpu_plans" / key]


def read_plan(path: str | os.PathLike) -> dict:
    """plan.json of a plan folder (a ValueError naming the file when it is not one of this PLAN_VERSION)."""
    f = Path(path) / PLAN_FILE
    plan = json.loads(f.read_text())
    if plan.get("version") != PLAN_VERSION:
        raise ValueError(f"{f}: plan version {plan.get('version')!r}, expected {PLAN_VERSION}")
    return plan


def find_plan(folder: str | os.PathLike, threads: int) -> Path | None:
    """The folder's plan at `threads`, if one was made (under the folder: only where no link leads out of it)."""
    root = Path(folder).resolve()
    for d in plan_dirs(folder, threads):
        if (d / PLAN_FILE).is_file() and (not d.is_relative_to(root) or (d / PLAN_FILE).resolve().is_relative_to(root)):
            return d
    return None


__all__ = ["LiteUnavailable", "PLAN_VERSION", "find_plan", "plan_dirs", "plan_key", "read_plan", "writable"]
