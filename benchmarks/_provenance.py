"""What a benchmark result records about where it ran: package versions and pagedkit's commit (the device's
copy of the tree may carry a stale .git, so the caller can name the commit in PAGEDKIT_COMMIT)."""

from __future__ import annotations

import importlib
import json
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedkit.apps.bench import report  # noqa: E402  (the commit and settings facts paged-bench records too)


def versions(modules=("triton", "onnxruntime", "onnx", "pagedkit")) -> dict:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version()}
    for mod in modules:
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception as exc:  # noqa: BLE001 - a missing package is a fact to record
            out[mod] = f"unavailable ({type(exc).__name__})"
    out["pagedkit_commit"] = report.pagedkit_commit()
    out["settings_env"] = report.settings_env()  # the kernel settings the environment overrode, if any
    return out


def write_result(path: Path, result: dict, indent: int = 1) -> None:
    """A result file: JSON, its folder made when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")
