"""The rows of benchmarks/attention.py: configurations, their inputs (seeded, built on the run device), the bytes
one call must move (the bandwidth floor) and the one-node ONNX model onnxruntime runs. Pure apart from the
tensors; tests/test_bench_attention.py checks the byte arithmetic.

A row is one step: every sequence adds `query_len` query tokens (1: a decode step; more: a prefill, or with
context > query_len a chunked prefill over a cached prefix) at positions past .. context - 1, past = context -
query_len (the last one attends to `context` keys, the new ones included). Decode rows are memory-bound (floor:
bytes / bandwidth), prefill rows compute-bound (floor: flops() / PEAK_TFLOP_S, the larger of the two). Inputs: random fp16 Q/K/V, caches filled with random values / codes,
a shuffled block table (a random permutation of the physical blocks, -1 past each sequence's blocks, one
spare block), attention_metadata [1, max_context, 0] (host int32) when asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BANDWIDTH_TB_S = 4.4  # H200 HBM3e peak
PEAK_TFLOP_S = 790.0  # H200 dense fp16 / bf16 tensor-core peak (about; FlashAttention-3 reaches ~740 forward)
ELEM_BYTES = {"fp16": 2.0, "int8": 1.0, "fp8": 1.0, "int4": 0.5}
CACHE_DTYPES = {"fp16": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
SCALE_CACHE_DTYPE = torch.float16  # PER_TOKEN scale caches
SOFTCAP = 30.0
# mixed contexts 1 .. 32k, in a fixed shuffled order (not sorted: kernels must not rely on it)
RAGGED = (4097, 1, 20000, 255, 32768, 17, 1500, 9000, 3, 513, 13000, 100, 2047, 6000, 1000, 3000)


@dataclass(frozen=True)
class Case:
    name: str
    contexts: tuple[int, ...]  # keys each sequence attends to (past = context - 1, one new token)
    block_size: int
    num_heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    cache: str = "fp16"  # fp16 | int8 | fp8 | int4
    quant: str = "NONE"  # NONE | PER_TENSOR | PER_CHANNEL | PER_TOKEN
    rotation: bool = False  # qk_rotation + v_rotation
    features: bool = False  # head_sink + softcap + QK-norm + rotary
    window: int = -1  # local_window_size
    note: str = ""
    query_len: int = 1  # new tokens per sequence (> 1: a prefill; causal)
    latent: bool = False  # kv_cache_layout LATENT (MLA): one cache [NB, BS, 1, head_size], V its leading v_head
    v_head: int = 0  # v_head_size of a LATENT row
    dtype: str = "float16"  # T (query, output; the float caches): float16 | bfloat16

    @property
    def batch(self) -> int:
        return len(self.contexts)

    def config(self) -> dict:
        same = len(set(self.contexts)) == 1
        return {"batch": self.batch, "context": self.contexts[0] if same else list(self.contexts),
                "block_size": self.block_size, "num_heads": self.num_heads, "kv_num_heads": self.kv_heads,
                "head_size": self.head_size, "cache": self.cache, "quant": self.quant, "rotation": self.rotation,
                "features": "head_sink+softcap+qk_norm+rotary" if self.features else None,
                "local_window_size": self.window, "query_tokens_per_sequence": self.query_len, "note": self.note,
                **({"dtype": self.dtype} if self.dtype != "float16" else {}),
                **({"kv_cache_layout": "LATENT", "v_head_size": self.v_head} if self.latent else {})}

    @property
    def prefill(self) -> bool:
        return self.query_len > 1


def _dec(name: str, batch: int, ctx: int, bs: int, **kw) -> Case:
    return Case(name, (ctx,) * batch, bs, **kw)


# DeepSeek's absorbed MLA: 16 heads over one latent cache of 512 latent + 64 rope channels
_MLA = dict(num_heads=16, kv_heads=1, head_size=576, latent=True, v_head=512)
_Q8 = {"int8": dict(cache="int8", quant="PER_TENSOR"), "fp8": dict(cache="fp8", quant="PER_TENSOR"), "fp16": {}}
CASES = {c.name: c for c in (
    _dec("fp16-b16-ctx4k-bs256", 16, 4096, 256),
    _dec("fp16-b16-ctx4k-bs16", 16, 4096, 16),
    _dec("int8-b16-ctx4k-bs16", 16, 4096, 16, **_Q8["int8"]),
    _dec("fp8-b16-ctx4k-bs16", 16, 4096, 16, **_Q8["fp8"]),
    *(_dec(f"{c}-b64-ctx8k-bs{bs}", 64, 8192, bs, **_Q8[c]) for c in ("fp16", "int8", "fp8") for bs in (16, 256)),
    _dec("fp16-b1-ctx32k-bs16", 1, 32768, 16),
    _dec("fp16-b1-ctx32k-bs256", 1, 32768, 256),
    _dec("int4-channel-b64-ctx8k-bs16", 64, 8192, 16, cache="int4", quant="PER_CHANNEL"),
    _dec("int4-token-rot-b64-ctx8k-bs16", 64, 8192, 16, cache="int4", quant="PER_TOKEN", rotation=True,
         note="PER_TOKEN scale caches + qk/v Hadamard rotation (pagedkit extensions)"),
    _dec("features-b16-ctx4k-bs16", 16, 4096, 16, features=True,
         note="head_sink + softcap 30 + QK-norm + rotary; compare fp16-b16-ctx4k-bs16"),
    _dec("fp16-b16-ctx1k-bs16", 16, 1024, 16, note="plain context 1024: what the window row should cost"),
    _dec("window1k-b16-ctx8k-bs16", 16, 8192, 16, window=1024, note="local_window_size 1024; compare fp16-b16-ctx1k-bs16"),
    Case("ragged-b16-bs16", RAGGED, 16, note="contexts mixed 1 .. 32768"),
    *(Case(f"prefill-{t}-b4-q4096-bs{bs}", (4096,) * 4, bs, query_len=4096, dtype=dt,
           note="causal prefill of 4 x 4096 tokens, no cached prefix")
      for t, dt in (("fp16", "float16"), ("bf16", "bfloat16")) for bs in (16, 256)),
    Case("chunk-fp16-b4-q1024-ctx4096-bs16", (4096,) * 4, 16, query_len=1024,
         note="chunked prefill: 1024 new tokens over a cached 3072-token prefix"),
    Case("prefill-fp16-b16-q512-bs16", (512,) * 16, 16, query_len=512, note="16 short prompts"),
    *(_dec(f"mla-{c}-b64-ctx4k-bs{bs}", 64, 4096, bs, **_MLA, **_Q8[c])
      for c in ("fp16", "fp8") for bs in (16, 64)),
    _dec("mla128-fp16-b64-ctx4k-bs64", 64, 4096, 64, **(_MLA | {"num_heads": 128}),
         note="DeepSeek-V3's 128 heads: compute-bound (~256 FLOPs per byte)"),
)}
QUICK = ("fp16-b16-ctx4k-bs256", "fp16-b16-ctx4k-bs16", "int8-b16-ctx4k-bs16", "fp16-b64-ctx8k-bs256")
DRY_CASES = {c.name: c for c in (  # --dry-run: CPU, tiny shapes
    Case("dry-fp16", (64, 64), 16, num_heads=4, kv_heads=2, head_size=32),
    Case("dry-int8-features", (64, 37), 16, num_heads=4, kv_heads=2, head_size=32, cache="int8", quant="PER_TENSOR",
         features=True),
    Case("dry-prefill", (24, 24), 16, num_heads=4, kv_heads=2, head_size=32, query_len=24),
    Case("dry-chunk", (40, 30), 16, num_heads=4, kv_heads=2, head_size=32, query_len=12),
    Case("dry-mla", (64, 37), 16, num_heads=4, kv_heads=1, head_size=48, latent=True, v_head=32),
)}


# ---- bytes and the floor ---------------------------------------------------------------------------------------
def traffic(case: Case) -> dict:
    """Bytes one call must move: every sequence's cached K and V over the keys it attends to (min(context,
    window) with a window; int4 = 0.5 byte per element; PER_TOKEN: a K and a V scale per token and KV head),
    plus the step's Q, new K / V and output (fp16)."""
    d = case.head_size
    side = math.ceil(d * ELEM_BYTES[case.cache])  # bytes of one token's head on one side (int4: packed pairs)
    sides = 1 if case.latent else 2  # LATENT: one cache (V is its leading channels)
    per_token = case.kv_heads * sides * side
    if case.quant == "PER_TOKEN":
        per_token += case.kv_heads * sides * SCALE_CACHE_DTYPE.itemsize
    read = sum(min(c, case.window) if case.window > 0 else c for c in case.contexts)
    t = case.batch * case.query_len
    dv = case.v_head if case.latent else d
    io = t * (case.num_heads * d * 2 + case.num_heads * dv * 2 + case.kv_heads * sides * d * 2)  # Q, output, new K/V
    return {"tokens_read": read, "kv_bytes_per_token": per_token, "kv": read * per_token, "q_kv_out": io,
            "total": read * per_token + io}


def flops(case: Case) -> float:
    """Tensor-core FLOPs of the attention (QK^T and PV, 2 * D and 2 * Dv per admitted (query, key) pair and head):
    query j of a sequence (position past + j) admits keys 0 .. past + j, or its last `window` of them."""
    pairs = 0
    for c in case.contexts:
        past = c - case.query_len
        for j in range(case.query_len):
            keys = past + j + 1
            pairs += min(keys, case.window) if case.window > 0 else keys
    dv = case.v_head if case.latent else case.head_size
    return 2.0 * (case.head_size + dv) * case.num_heads * pairs


def compute_floor_ms(total_flops: float, peak_tflop_s: float = PEAK_TFLOP_S) -> float:
    return total_flops / (peak_tflop_s * 1e12) * 1e3


def floor_ms(total_bytes: float, bandwidth_tb_s: float = BANDWIDTH_TB_S) -> float:
    return total_bytes / (bandwidth_tb_s * 1e12) * 1e3


def effective_tb_s(total_bytes: float, ms: float) -> float:
    return total_bytes / (ms * 1e-3) / 1e12


# ---- inputs ------------------------------------------------------------------------------------------------------
def build_inputs(case: Case, device: torch.device, seed: int = 0, metadata: bool = True
                 ) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(inputs by contract name, attributes, requested outputs) of the row; the same seed gives the same values."""
    gcpu = torch.Generator().manual_seed(seed)
    gdev = torch.Generator(device=device).manual_seed(seed)
    t_dtype = getattr(torch, case.dtype)
    b, h, hkv, d, bs = case.batch, case.num_heads, case.kv_heads, case.head_size, case.block_size

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=gdev, device=device, dtype=t_dtype) * scale

    def uniform(*shape, lo, hi, dtype=torch.float32):
        return (torch.rand(shape, generator=gdev, device=device) * (hi - lo) + lo).to(dtype)

    def codes(shape):
        if case.cache == "fp16":
            return randn(*shape)
        if case.cache == "fp8":
            return randn(*shape, scale=4.0).to(torch.float8_e4m3fn)  # scale 0.25: values ~ N(0, 1)
        lo, hi = (-127, 128) if case.cache == "int8" else (0, 256)  # int4: two nibbles (code + 8) per byte
        return torch.randint(lo, hi, shape, generator=gdev, device=device, dtype=CACHE_DTYPES[case.cache])

    need = [-(-c // bs) for c in case.contexts]
    num_blocks = sum(need) + 1  # one spare block nobody maps
    perm = torch.randperm(num_blocks, generator=gcpu).to(torch.int32)
    table = torch.full((b, max(need)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    width = (d + 1) // 2 if case.cache == "int4" else d
    ql = case.query_len
    x = {"query": randn(b * ql, h * d), "key": randn(b * ql, hkv * d), "value": randn(b * ql, hkv * d),
         "key_cache": codes((num_blocks, bs, hkv, width)), "value_cache": codes((num_blocks, bs, hkv, width)),
         "cumulative_sequence_length": torch.arange(b + 1, dtype=torch.int32, device=device) * ql,
         "past_seqlens": torch.tensor([c - ql for c in case.contexts], dtype=torch.int32, device=device),
         "block_table": table.to(device)}
    attrs: dict = {"num_heads": h, "kv_num_heads": hkv}
    outputs = ["output", "key_cache_out", "value_cache_out"]
    if case.latent:  # one latent cache; the scale is explicit (DeepSeek: 1 / sqrt(192))
        del x["value"], x["value_cache"]
        attrs.update(kv_cache_layout="LATENT", v_head_size=case.v_head, scale=1 / math.sqrt(192))
        outputs.remove("value_cache_out")
    if case.quant != "NONE":
        step = {"int8": (1 / 64, 1 / 48), "fp8": (0.25, 0.3), "int4": (0.25, 0.3)}[case.cache]
        for s in ("k",) if case.latent else ("k", "v"):
            attrs[f"{s}_quant_type"] = case.quant
            if case.cache == "int4":
                attrs[f"{s}_cache_dtype"] = "int4"
            if case.quant == "PER_TENSOR":
                x[f"{s}_scale"] = uniform(1, lo=step[0], hi=step[1])
            elif case.quant == "PER_CHANNEL":
                x[f"{s}_scale"] = uniform(hkv, 1, d, lo=step[0], hi=step[1])
            else:  # PER_TOKEN
                x[f"{s}_scale_cache"] = uniform(num_blocks, bs, hkv, lo=step[0], hi=step[1], dtype=SCALE_CACHE_DTYPE)
                outputs.append(f"{s}_scale_cache_out")
    if case.rotation:
        attrs["qk_rotation"] = attrs["v_rotation"] = 1
    if case.features:
        x["head_sink"] = randn(h)
        x["q_norm_weight"] = 1 + randn(d, scale=0.1)
        x["k_norm_weight"] = 1 + randn(d, scale=0.1)
        angle = uniform(max(case.contexts) + 1, d // 2, lo=0.0, hi=6.28)
        x["cos_cache"], x["sin_cache"] = angle.cos().to(t_dtype), angle.sin().to(t_dtype)
        attrs.update(do_rotary=1, softcap=SOFTCAP)
    if case.window > 0:
        attrs["local_window_size"] = case.window
    if metadata:
        x["attention_metadata"] = torch.tensor([ql, max(case.contexts), 0], dtype=torch.int32)  # host memory
    return x, attrs, outputs


CACHE_INPUTS = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")  # written in place


def arm_copy(base: dict) -> dict:
    """One arm's inputs: its own copies of the caches (written in place), the rest shared (read only)."""
    return {k: (v.clone() if k in CACHE_INPUTS else v) for k, v in base.items()}


# ---- the one-node ONNX model -------------------------------------------------------------------------------------
def onnx_model(inputs: dict, attrs: dict, outputs: list[str]):
    """A one-node PagedAttention model over the inputs, built with pagedkit's node builder (validated);
    tensor names are the contract names, each `<cache>_out` output aliasing its cache input."""
    from onnx import helper

    from pagedkit.validators import make_paged_attention_node
    from pagedkit.validators.nodeview import onnx_dtype_of

    info = {n: (onnx_dtype_of(t), tuple(t.shape)) for n, t in inputs.items()}
    q = inputs["query"]
    dv = attrs.get("v_head_size") or inputs["value"].shape[1] // attrs["kv_num_heads"]
    info["output"] = (onnx_dtype_of(q), (q.shape[0], attrs["num_heads"] * dv))
    for o in outputs[1:]:
        info[o] = info[o[:-len("_out")]]
    node = make_paged_attention_node({n: n for n in inputs}, {n: n for n in outputs}, name="paged_attention",
                                     value_info=info, **attrs)
    graph = helper.make_graph([node], "paged_attention_bench",
                              [helper.make_tensor_value_info(n, *info[n]) for n in node.input if n],
                              [helper.make_tensor_value_info(n, *info[n]) for n in node.output if n])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                  helper.make_opsetid("com.microsoft", 1)])
