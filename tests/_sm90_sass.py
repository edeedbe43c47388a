"""Print the SASS of the decode kernel's attention for GQA int8 / fp8 decode (batch 64, context 4096, 32 / 8 heads,
head 128) compiled for sm_90 on any machine (Triton's ptxas / nvdisasm): python tests/_sm90_sass.py int8|fp8 ASM [MMA]
(the sides, k / v, with the packed conversions; with int8 tensor-core dots). Used by tests/test_quant_convert.py; run without TRITON_INTERPRET."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import triton

from pagedkit.kernels.triton import common, decode

B, H, HKV, D, C = 64, 32, 8, 128, 4352


def sass(fmt: str, asm: str, mma: str = "") -> str:
    """SASS of the attention kernel for GQA int8 / fp8 decode (batch 64, context 4096) compiled for sm_90."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedkit.kernels.triton import _decode_kernels as K

    captured = {}
    real = K._attn_kernel

    class Capture:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            def run(*args, **kw):
                captured.update(args=args, kw=kw)
            return run

    K._attn_kernel = Capture(K._attn_kernel)
    K._reduce_kernel = Capture(K._reduce_kernel)
    decode.QUANT_ASM, decode.INT8_MMA = decode.parse_quant_asm(asm or "0"), mma
    dt = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[fmt]
    kc = torch.zeros(B, HKV, C, D, dtype=dt)
    sf = common.SideFormat(common.FMT_INT8 if fmt == "int8" else common.FMT_FP8, common.SCALE_TENSOR)
    decode._paged_decode(
        torch.zeros(B, H, D, dtype=torch.float16), key_cache=kc, value_cache=torch.zeros_like(kc), k_format=sf,
        v_format=sf, cumulative_sequence_length=torch.ones(B, dtype=torch.int32),
        past_seqlens=torch.full((B,), 4095, dtype=torch.int32), block_table=torch.zeros(B, 1, dtype=torch.int32),
        num_heads=H, kv_num_heads=HKV, head_size=D, v_head_size=D, scale=0.0884, k_scale=torch.ones(HKV * D),
        v_scale=torch.ones(HKV * D), k_scale_cache=None, v_scale_cache=None, query_positions=None, softcap=0.0,
        local_window_size=0, is_causal=True, head_sink=None, attention_bias=None, qk_output=0, v_rotation=False,
        max_query_len=1, max_kv_len=4096, num_splits=None, bnsh=True, row_pad=1, bias_after_softcap=True)
    fn, args, kw = real, list(captured["args"]), dict(captured["kw"])
    num_warps = kw.pop("num_warps")
    stages = kw.pop("num_stages", 3)
    ptr = {torch.int8: "*i8", torch.uint8: "*u8", torch.float16: "*fp16", torch.float32: "*fp32",
           torch.int32: "*i32", torch.int64: "*i64"}
    sig, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            constexprs[p.name] = kw.get(p.name, p.default)
            continue
        v = args.pop(0)
        if isinstance(v, torch.Tensor):
            sig[p.name] = ptr[v.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        elif v == 1:
            sig[p.name], constexprs[p.name] = "constexpr", 1
        else:
            sig[p.name] = "i32"
            if v % 16 == 0 and v:
                attrs[(i,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": stages})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"pagedkit_{fmt}_{asm or 0}_{mma or 0}_{os.getpid()}.cubin")
    with open(path, "wb") as f:
        f.write(compiled.asm["cubin"])
    try:
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)


if __name__ == "__main__":
    sys.stdout.write(sass(sys.argv[1], sys.argv[2].replace("0", ""), sys.argv[3] if len(sys.argv) > 3 else ""))
