"""benchmarks/probes/gemv_probe.py's CPU dry run (the GPU probe of the decode GEMV kernel, not yet run on a device):
every config of a small grid, plain / rms / silu, against float64 through the interpreter; a broken config makes
it exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _dry(*grid: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "probes" / "gemv_probe.py"), "--dry-run", *grid],
                          capture_output=True, text=True, env=env, timeout=600)


def test_dry_run_checks_every_config():
    done = _dry("--bn", "4", "16", "--bk", "256", "--warps", "4", "--stages", "3", "--rows", "1", "3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8 configs x 3 kinds" in done.stdout, done.stdout


def test_dry_run_fails_a_wrong_kernel(tmp_path):
    """Teeth: the rms fold with its gamma dropped (a plausible bug) must make the dry run fail."""
    src = (REPO / "pagedkit" / "kernels" / "triton" / "linear.py").read_text()
    bad = src.replace("x = (sm * rstd_r * g).to(out_dt)", "x = (sm * rstd_r).to(out_dt)")
    assert bad != src
    pkg = tmp_path / "repo"
    import shutil

    shutil.copytree(REPO / "pagedkit", pkg / "pagedkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "benchmarks", pkg / "benchmarks", ignore=shutil.ignore_patterns("__pycache__", "results"))
    (pkg / "pagedkit" / "kernels" / "triton" / "linear.py").write_text(bad)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(pkg))
    done = subprocess.run([sys.executable, str(pkg / "benchmarks" / "probes" / "gemv_probe.py"), "--dry-run", "--bn", "4",
                           "--bk", "256", "--warps", "4", "--stages", "3", "--rows", "2"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr[-2000:]
