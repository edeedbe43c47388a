"""Kernels that only the interpreter runs on the CPU compile for an H100 / H200 (sm_90) too, without a GPU
(tests/aot_compile.py: launches recorded in the interpreter, then triton.compile for GPUTarget("cuda", 90, 32)):
the int64 split-K product (with and without the SwiGLU operand), its norm, and the decode cache write fused into
the attention kernel in float16 and bfloat16, beside the rest of a decode step's Triton launches (residual norm,
cache write, split-KV attention and reduce, SwiGLU, argmax). Catches what the interpreter accepts and the compiler
does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
triton = pytest.importorskip("triton")  # under CI a failure (conftest.py)


def _backend() -> bool:
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _backend(), reason="triton without its NVIDIA backend")
def test_kernels_compile_for_sm90(tmp_path):
    rec = tmp_path / "launches.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    subprocess.run([sys.executable, str(HERE / "aot_compile.py"), "record", str(rec)], check=True, env=env,
                   capture_output=True)
    env.pop("TRITON_INTERPRET")
    out = subprocess.run([sys.executable, str(HERE / "aot_compile.py"), "compile", str(rec)], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("compiled ")]
    want = ["_attn_kernel [FUSED=True,T_BF16=False]", "_attn_kernel [FUSED=True,T_BF16=True]",
            "_attn_kernel [FUSED=False,T_BF16=False]", "_reduce_kernel []", "_reduce_kernel []", "_reduce_kernel []",
            "_splitk_kernel [SILU=False,PRE2=True]", "_splitk_kernel [SILU=True,PRE2=False]", "_rms_kernel [ACC=True]",
            "_rms_kernel [ACC=True]", "_rms_kernel [ACC=False]", "_write_kernel []", "_silu_mul_kernel []",
            "_argmax_chunk_kernel []", "_argmax_final_kernel []"]
    assert sorted(ln.split(" ptx")[0].removeprefix("compiled ") for ln in lines) == sorted(want), out.stdout
