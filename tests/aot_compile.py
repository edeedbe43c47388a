"""Compile Triton kernels for an H100 / H200 (sm_90) without a GPU: what Triton's interpreter never checks
(types, layouts, inline asm, the backend's passes). Used by tests/test_triton_compile.py in two processes:

    python tests/aot_compile.py record OUT.json   # TRITON_INTERPRET=1: run launchers, record each launch's
                                                   # signature (argument types) and constexprs instead of running it
    python tests/aot_compile.py compile IN.json    # no interpreter: triton.compile every recorded launch for
                                                   # GPUTarget("cuda", 90, 32); prints one line per kernel

The scenarios are launcher calls of the kernels that only the interpreter tests cover (the int64 split-K product and
its norm, the decode cache write fused into attention), and beside them the rest of a decode step's Triton
launches (the plain residual norm, the cache write, the split-KV attention and its reduce, SwiGLU, argmax)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32", "int64": "i64", "int16": "i16",
          "uint8": "u8", "int8": "i8"}


def _type(v) -> str:
    import torch

    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[str(v.dtype).removeprefix("torch.")]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i64" if abs(v) >= 2 ** 31 else "i32"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"argument of type {type(v).__name__}")


class _Recorder:
    """Stands in for an interpreted kernel: kernel[grid](*args, **kw) records instead of running."""

    def __init__(self, fn, out: list):
        self.fn, self.out = fn, out

    def __getitem__(self, grid):
        def launch(*args, **kw):
            params = inspect.signature(self.fn.fn).parameters
            values = dict(zip(self.fn.arg_names, args)) | {k: v for k, v in kw.items() if k in params}
            sig, cex = {}, {}
            for name in self.fn.arg_names:
                if "constexpr" in str(params[name].annotation):
                    sig[name] = "constexpr"
                    v = values.get(name, params[name].default)
                    cex[name] = v if isinstance(v, (bool, int, float)) else str(v)
                else:
                    sig[name] = _type(values[name])
            opts = {k: v for k, v in kw.items() if k in ("num_warps", "num_stages")}
            self.out.append({"kernel": f"{self.fn.fn.__module__}:{self.fn.fn.__name__}", "sig": sig, "cex": cex,
                             "opts": opts})
        return launch


def _scenarios():
    import torch

    sys.path.insert(0, str(HERE))
    from test_fused_write import CASES, _attend, _step

    from pagedkit.kernels.triton import argmax, norm, splitk, swiglu

    for case in (0, 1):  # float16 packed QKV with RoPE; bfloat16 separate inputs, interleaved RoPE
        B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[case]
        q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(case, B, H, Hkv, D, BS, dtype, nq, rot, packed)
        _attend(q, k, v, csl, past, table, kc, vc, cos, sin, fused=True, H=H, Hkv=Hkv, D=D, interleaved=inter,
                offset=off, splits=3)
    for dtype, silu, k in ((torch.float16, False, 2048), (torch.bfloat16, True, 8192)):  # slab before the gate / not
        n = 128
        a = torch.randn(4, 2 * k if silu else k).to(dtype)
        b = torch.randn(k, n).to(dtype)
        acc = splitk.accumulate(a, b, silu)
        norm.rms_norm_acc(acc, torch.ones(n, dtype=dtype), 1e-6, skip=torch.randn(4, n).to(dtype))
    x = torch.randn(4, 128).half()
    norm.rms_norm(x, torch.ones(128).half(), 1e-6, skip=torch.randn(4, 128).half(), want_sum=True)
    # the unfused decode step beside them: the cache write, the split-KV attention and its reduce (float16, RoPE)
    B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[0]
    q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(0, B, H, Hkv, D, BS, dtype, nq, rot, packed)
    _attend(q, k, v, csl, past, table, kc, vc, cos, sin, fused=False, H=H, Hkv=Hkv, D=D, splits=3)
    swiglu.silu_mul(torch.randn(2, 256).half(), 128)
    argmax.argmax_rows(torch.randn(2, 5000).half())


def record(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "record runs the launchers in the interpreter"
    from pagedkit.kernels.triton import _decode_kernels, argmax, cache_write, norm, splitk, swiglu

    out: list = []
    for mod, name in ((_decode_kernels, "_attn_kernel"), (_decode_kernels, "_reduce_kernel"),
                      (cache_write, "_write_kernel"), (splitk, "_splitk_kernel"), (norm, "_rms_kernel"),
                      (swiglu, "_silu_mul_kernel"), (argmax, "_argmax_chunk_kernel"),
                      (argmax, "_argmax_final_kernel")):
        setattr(mod, name, _Recorder(getattr(mod, name), out))
    try:
        _scenarios()
    except Exception:  # noqa: BLE001 - a launcher reading a recorded (never written) output: what ran is recorded
        pass
    Path(out_path).write_text(json.dumps(out))


def compile_all(in_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile needs the real compiler"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    for rec in json.loads(Path(in_path).read_text()):
        mod, name = rec["kernel"].split(":")
        fn = getattr(importlib.import_module(mod), name)
        cex = dict(rec["cex"])
        cex.update({k: False for k in ("INTERP",) if k in cex})
        if "PDL" in cex:
            cex["PDL"] = 2  # as on a Hopper GPU: griddepcontrol in the kernel
        kernel = triton.compile(ASTSource(fn=fn, signature=rec["sig"], constexprs=cex), target=target,
                                options=rec["opts"])
        flags = ",".join(f"{k}={cex[k]}" for k in ("FUSED", "T_BF16", "SILU", "PRE2", "ACC") if k in cex)
        print(f"compiled {name} [{flags}] ptx {len(kernel.asm['ptx'])} chars, shared {kernel.metadata.shared} B")


if __name__ == "__main__":
    {"record": record, "compile": compile_all}[sys.argv[1]](sys.argv[2])
