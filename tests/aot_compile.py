"""Compile Triton kernels for an H100 / H200 (sm_90) without a GPU: what Triton's interpreter never checks
(types, layouts, inline asm, the backend's passes). Used by tests/test_triton_compile.py in two processes:

    python tests/aot_compile.py record OUT.json   # TRITON_INTERPRET=1: run launchers, record each launch's
                                                   # signature (argument types) and constexprs instead of running it
    python tests/aot_compile.py compile IN.json    # no interpreter: triton.compile every recorded launch for
                                                   # GPUTarget("cuda", 90, 32); prints one line per kernel

The scenarios are launcher calls of a decode step's Triton launches, which the CPU tests run only in the
interpreter: the residual norm, the cache write, the split-KV attention and its reduce (float16 with packed QKV and
RoPE; bfloat16 with separate inputs and interleaved RoPE), SwiGLU, argmax."""

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
            sig, cex, div = {}, {}, []
            for i, name in enumerate(self.fn.arg_names):
                if "constexpr" in str(params[name].annotation):
                    sig[name] = "constexpr"
                    v = values.get(name, params[name].default)
                    cex[name] = v if isinstance(v, (bool, int, float)) else str(v)
                else:
                    v = values[name]
                    sig[name] = _type(v)
                    # what the JIT specializes on a GPU: 16-byte aligned pointers, integers divisible by 16
                    if (hasattr(v, "data_ptr") and v.data_ptr() % 16 == 0) or (
                            isinstance(v, int) and not isinstance(v, bool) and v and v % 16 == 0):
                        div.append(i)
            opts = {k: v for k, v in kw.items() if k in ("num_warps", "num_stages")}
            self.out.append({"kernel": f"{self.fn.fn.__module__}:{self.fn.fn.__name__}", "sig": sig, "cex": cex,
                             "opts": opts, "div": div})
        return launch


def _decode_step(dtype, packed: bool, interleaved: bool) -> None:
    """write_kv then the split-KV attention and its reduce over a random 3-sequence decode step (RoPE, a paged
    float cache of 16-token blocks, 3 splits)."""
    import math

    import torch

    from pagedkit.kernels.triton import common, decode
    from pagedkit.kernels.triton.cache_write import write_kv

    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, BS = 3, 8, 2, 64, 16
    past = torch.tensor([5, 40, 17], dtype=torch.int32)
    csl = torch.arange(B + 1, dtype=torch.int32)
    table = torch.randperm(B * 4, generator=g)[:B * 4].reshape(B, 4).to(torch.int32)
    qkv = torch.randn(B, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q, k, v = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
    if not packed:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kc, vc = (torch.randn(B * 4, BS, Hkv, D, generator=g).to(dtype) for _ in range(2))
    ang = torch.arange(4 * BS)[:, None] * 10000.0 ** (-torch.arange(D // 2) / (D // 2))
    flt = common.SideFormat(common.FMT_FLOAT, common.SCALE_NONE)
    qr = write_kv(q, k, v, num_heads=H, kv_num_heads=Hkv, head_size=D, cumulative_sequence_length=csl,
                  past_seqlens=past, block_table=table, key_cache=kc, value_cache=vc, k_format=flt, v_format=flt,
                  cos_cache=ang.cos().to(dtype), sin_cache=ang.sin().to(dtype), rotary_interleaved=interleaved,
                  unique_slots=True)
    decode._paged_decode(qr, key_cache=kc, value_cache=vc, k_format=flt, v_format=flt,
                         cumulative_sequence_length=csl, past_seqlens=past, block_table=table, num_heads=H,
                         kv_num_heads=Hkv, head_size=D, v_head_size=D, scale=1.0 / math.sqrt(D), k_scale=None,
                         v_scale=None, k_scale_cache=None, v_scale_cache=None, query_positions=None, softcap=0.0,
                         local_window_size=0, is_causal=True, head_sink=None, attention_bias=None, qk_output=0,
                         v_rotation=False, max_query_len=1, max_kv_len=0, num_splits=3)


def _scenarios():
    import torch

    from pagedkit.kernels.triton import argmax, norm, swiglu

    x = torch.randn(4, 128).half()
    norm.rms_norm(x, torch.ones(128).half(), 1e-6, skip=torch.randn(4, 128).half(), want_sum=True)
    _decode_step(torch.float16, packed=True, interleaved=False)
    _decode_step(torch.bfloat16, packed=False, interleaved=True)
    swiglu.silu_mul(torch.randn(2, 256).half(), 128)
    argmax.argmax_rows(torch.randn(2, 5000).half())


def _moe_and_prefetch():
    """The fused MoE (float16 swiglu, bfloat16 gated relu with fc3, QMoE 4-bit blocks of 32 with zero points, 8-bit
    per row) and the L2 prefetch kernel (bulk and line requests; compiled with RECORD off, as on a GPU)."""
    import torch

    from pagedkit.kernels.triton import moe, prefetch

    sys.path.insert(0, str(HERE))
    from test_triton_moe import _packed_case, make

    for dtype, act, fusion, fc3 in ((torch.float16, "swiglu", 1, False), (torch.bfloat16, "relu", 0, True)):
        xs, top_e, top_w, w, attrs = make(n_tok=5, k=2, n_exp=4, hidden=64, inter=64, dtype=dtype, act=act,
                                          fusion=fusion, fc3=fc3)
        moe.fused_moe(xs, top_e, top_w, w, attrs)
    g = torch.Generator().manual_seed(3)
    for bits, block, zp in ((4, 32, True), (8, 0, False)):
        xs, top_e, top_w, w, attrs = make(n_tok=5, k=2, n_exp=4, hidden=64, inter=64)
        w[0], _ = _packed_case(w[0], bits, block, zp, g, torch.float16)
        w[2], _ = _packed_case(w[2], bits, block, zp, g, torch.float16)
        moe.fused_moe(xs, top_e, top_w, w, attrs)
    from pagedkit.kernels.triton import linear

    g = torch.Generator().manual_seed(5)
    for kind in linear.KINDS:  # the decode products at Llama-3.2-1B's widths (float16), rms also in bfloat16
        for dtype in ((torch.float16, torch.bfloat16) if kind == "rms" else (torch.float16,)):
            k = 8192 if kind == "silu" else 2048
            a = torch.randn(3, 2 * k if kind == "silu" else k, generator=g).to(dtype)
            linear.linear(kind, a, torch.randn(64, k, generator=g).to(dtype),
                          skip=torch.randn(3, k, generator=g).to(dtype) if kind == "rms" else None,
                          gamma=torch.ones(k, dtype=dtype) if kind == "rms" else None, want_sum=kind == "rms")
    from pagedkit.kernels.triton import moe_route

    for t_, e_, k_, dtype in ((1, 64, 6, torch.float16), (32, 64, 6, torch.bfloat16), (24, 8, 2, torch.float32)):
        moe_route.route_plan(torch.randn(t_, e_, generator=g).to(dtype), k_, dtype != torch.float16, moe.BLOCK_M)
    t = torch.zeros(1 << 16, dtype=torch.float16)
    for mode in prefetch.MODES:
        prefetch.prefetch_l2(t, 1 << 17, mode, marks=torch.zeros(1 << 10, dtype=torch.int32))


def record(out_path: str) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "record runs the launchers in the interpreter"
    from pagedkit.kernels.triton import (_decode_kernels, argmax, cache_write, linear, moe, moe_route, norm, prefetch,
                                         swiglu)

    out: list = []
    for mod, name in ((_decode_kernels, "_attn_kernel"), (_decode_kernels, "_reduce_kernel"),
                      (cache_write, "_write_kernel"), (norm, "_rms_kernel"),
                      (swiglu, "_silu_mul_kernel"), (argmax, "_argmax_chunk_kernel"),
                      (argmax, "_argmax_final_kernel"), (moe, "_fc1_kernel"), (moe, "_fc2_kernel"),
                      (prefetch, "_prefetch_kernel"), (linear, "_linear_kernel"), (moe_route, "_route_kernel")):
        setattr(mod, name, _Recorder(getattr(mod, name), out))
    for part in (_scenarios, _moe_and_prefetch):
        try:
            part()
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
        cex.update({k: False for k in ("INTERP", "UPCAST", "RECORD") if k in cex})  # as on a GPU
        if "PDL" in cex:
            cex["PDL"] = 2  # as on a Hopper GPU: griddepcontrol in the kernel
        if "PREFETCH" in cex:
            cex["PREFETCH"] = True  # as on a Hopper GPU: the weight slab's bulk L2 requests
        attrs = {(i,): [["tt.divisibility", 16]] for i in rec.get("div", [])}
        kernel = triton.compile(ASTSource(fn=fn, signature=rec["sig"], constexprs=cex, attrs=attrs), target=target,
                                options=rec["opts"])
        first = next(t for t in rec["sig"].values() if t.startswith("*"))  # the first tensor's type
        print(f"compiled {name} [{first}] ptx {len(kernel.asm['ptx'])} chars, shared {kernel.metadata.shared} B")


if __name__ == "__main__":
    {"record": record, "compile": compile_all}[sys.argv[1]](sys.argv[2])
