"""A decode step's Triton kernels, which the CPU tests run only in the interpreter, compile for an H100 / H200
(sm_90) too, without a GPU (tests/aot_compile.py: launches recorded in the interpreter, then triton.compile for
GPUTarget("cuda", 90, 32)): the residual norm, the cache write, the split-KV attention and its reduce in float16 and
bfloat16, SwiGLU, argmax, the fused MoE (float and QMoE 4 / 8-bit experts), its routing kernel, the decode GEMV and
the L2 prefetch. Catches what the interpreter accepts and the compiler does not (with the device's triton 3.6 on
the path too: the MoE weight tile's early constexpr return, which 3.8 compiles and 3.6 does not)."""

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
    want = ["_rms_kernel [*fp16]", "_write_kernel [*fp16]", "_attn_kernel [*fp16]", "_reduce_kernel [*fp32]",
            "_write_kernel [*bf16]", "_attn_kernel [*bf16]", "_reduce_kernel [*fp32]", "_silu_mul_kernel [*fp16]",
            "_argmax_chunk_kernel [*fp16]", "_argmax_final_kernel [*i64]",
            "_fc1_kernel [*fp16]", "_fc2_kernel [*fp16]", "_fc1_kernel [*bf16]", "_fc2_kernel [*bf16]",
            "_fc1_kernel [*fp16]", "_fc2_kernel [*fp16]", "_fc1_kernel [*fp16]", "_fc2_kernel [*fp16]",
            "_prefetch_kernel [*u8]", "_prefetch_kernel [*u8]", "_linear_kernel [*fp16]", "_linear_kernel [*fp16]",
            "_linear_kernel [*fp16]", "_linear_kernel [*bf16]",
            "_route_kernel [*fp16]", "_route_kernel [*bf16]", "_route_kernel [*fp32]"]
    assert sorted(ln.split(" ptx")[0].removeprefix("compiled ") for ln in lines) == sorted(want), out.stdout
