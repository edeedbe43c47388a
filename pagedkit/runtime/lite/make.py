"""Make a model folder's CPU plan when it is missing (runtime/lite/artifact.py says what and where): in this process
when it has imported torch already, else in a child process that does (`python -m pagedkit.runtime.lite.compile`),
so that a torch-free caller stays torch-free."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from . import artifact
from .artifact import PLAN_FILE, LiteUnavailable, find_plan, plan_dirs


def ensure_plan(folder: str | os.PathLike, threads: int, timeout: float = 900, in_process: bool | None = None
                ) -> Path:
    """The folder's plan at `threads`, made first if missing: in this process when it has imported torch already
    (in_process None), else by a child process (it imports torch; this process does not). LiteUnavailable when
    the model cannot run on this path (from a child: also when the folder is bad, with Generator's reason); in
    this process a bad folder raises what Generator raises."""
    found = find_plan(folder, threads)
    if found is not None:
        return found
    folder = Path(folder).resolve()
    out = plan_dirs(folder, threads)[0 if artifact.writable(folder) else 1].resolve()
    if in_process if in_process is not None else "torch" in sys.modules:
        from .compile import write_plan

        return write_plan(folder, threads, out)
    cmd = [sys.executable, "-m", "pagedkit.runtime.lite.compile", str(folder), "--threads", str(threads),
           "--out", str(out)]
    # run from the folder holding this pagedkit, so that the child imports the same one (installed or not)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         cwd=Path(__file__).resolve().parents[3])
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    answer = json.loads(lines[-1]) if lines else {}
    if res.returncode != 0 or "refused" in answer or not (out / PLAN_FILE).is_file():
        why = answer.get("refused") or (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise LiteUnavailable(f"{folder}: no torch-free CPU plan: {why}")
    return out


__all__ = ["ensure_plan"]
