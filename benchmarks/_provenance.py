"""What a benchmark result records about where it ran: package versions and pagedkit's commit (the device's
copy of the tree may carry a stale .git, so the caller can name the commit in PAGEDKIT_COMMIT)."""

from __future__ import annotations

import importlib
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def versions(modules=("triton", "onnxruntime", "onnx", "pagedkit")) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in modules:
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception as exc:  # noqa: BLE001 - a missing package is a fact to record
            out[mod] = f"unavailable ({type(exc).__name__})"
    try:
        out["pagedkit_commit"] = os.environ.get("PAGEDKIT_COMMIT") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=REPO, timeout=10,
            check=False).stdout.strip() or None
    except Exception:  # noqa: BLE001
        out["pagedkit_commit"] = None
    # the kernel settings the environment overrode (PAGEDKIT_QUANT_ASM, PAGEDKIT_INT8_MMA, ...), if any
    out["settings_env"] = {k: v for k, v in sorted(os.environ.items())
                           if k.startswith("PAGEDKIT_") and k != "PAGEDKIT_COMMIT"}
    return out
