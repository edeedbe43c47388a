"""PagedAttention on Triton (variant "triton_paged"): the cache-write prologue (`cache_write.write_kv`: one
launch) then split-KV attention (`decode.paged_decode`: attention + reduce), both `torch.library` custom
ops (`ops.py`), no host syncs and no host reads of device tensors, so one call is CUDA-graph capturable.

Inputs by contract name (query [N, H*D] or packed [N, (H + 2*Hkv)*D], caches [NB, BS, Hkv, Dc] updated in
place); `attention_metadata` (host int32 [2 or 3]: max_query_len, max_kv_len[, lower bound]; 0 = unknown)
only sizes the launch (the number of KV splits), never a mask: the split ranges come from each sequence's
real extent in the kernel, so a wrong bound costs speed, not correctness.

Serves every PagedAttention feature on CUDA for T in {float16, bfloat16}. The attention kernel tiles rows of
(query tokens x the KV head's query heads); a prefill's row chunks run as parallel programs (query-chunk
lanes, sized from attention_metadata's max_query_len), each walking only the KV tiles its causal / window
range reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from pagedkit.validators.contract import PAGED_ATTENTION

from ..attention_math import default_scale
from ..variant import OP_FEATURES, KernelVariant
from . import common

NAME = "triton_paged"
MAX_HEAD_SIZE = 256  # Q/K head size the attention kernel tiles in registers (LATENT: up to 576)
MAX_LATENT_HEAD_SIZE = 576
_DEFAULTS = PAGED_ATTENTION.defaults()


def _supports(info: Any) -> str | None:
    if not common.HAVE_TRITON:
        return "triton is not installed (pip install 'pagedkit[gpu]')"
    limit = MAX_LATENT_HEAD_SIZE if info.layout == "LATENT" else MAX_HEAD_SIZE
    if info.head_size is not None and info.head_size > limit:
        return f"head_size {info.head_size} > {limit}"
    return None


VARIANT = KernelVariant(
    name=NAME,
    op="PagedAttention",
    entry=f"{__name__}:paged_attention",
    devices=("cuda",),
    dtypes=("float16", "bfloat16"),
    capturable=True,
    features=OP_FEATURES["PagedAttention"],
    supports=_supports,
    plans=("mixed",),
    description="Triton: one cache-write launch (split, QK-norm, RoPE, rotation, quantization, scatter) and "
                "split-KV attention over the block table (one program per sequence x KV head x split x query-chunk "
                "lane, every query head of the group, in-kernel dequantization) with a reduce. CUDA-graph "
                "capturable.",
    limits=f"head_size <= {MAX_HEAD_SIZE} ({MAX_LATENT_HEAD_SIZE} with LATENT); needs triton",
)


def supports(info: Any) -> str | None:
    return VARIANT.refusal(info)


def _bounds(meta: torch.Tensor | None) -> tuple[int, int]:
    """(max_query_len, max_kv_len) from the host-side attention_metadata (0 = unknown)."""
    if meta is None:
        return 0, 0
    if meta.device.type != "cpu":
        raise ValueError("input 'attention_metadata': expected a CPU (host) tensor, got one on "
                         f"{meta.device} (reading it would sync with the device)")
    vals = [int(v) for v in (meta.tolist() if meta.dim() == 1 else meta.reshape(-1).tolist())]
    if len(vals) not in (2, 3) or min(vals) < 0:
        raise ValueError(f"input 'attention_metadata': expected 2 or 3 entries >= 0, got {vals}")
    return vals[0], vals[1]


def paged_attention(inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None, validate: bool = True,
                    **attributes: Any) -> dict[str, torch.Tensor]:
    """com.microsoft::PagedAttention on the Triton kernels; same results as the reference."""
    return run(inputs, outputs=outputs, validate=validate, fused_mla=False, **attributes)


@dataclass
class Prepared:
    """One call's inputs and attributes, decoded once (host facts only): what the prologue and every attention
    route (this module's split-KV kernels, sdpa_prefill's fused attention) read."""

    x: dict  # contract name -> tensor, absent inputs dropped
    a: dict  # attributes with the contract's defaults
    nh: int
    hkv: int
    d: int  # Q / K head size
    dv: int  # V head size (LATENT: v_head_size)
    latent: bool
    kf: Any  # common.SideFormat of the key cache
    vf: Any  # ... of the value cache (None with LATENT)
    k_scale: torch.Tensor | None  # static scale vectors (PER_TENSOR / PER_CHANNEL)
    v_scale: torch.Tensor | None
    max_q: int  # attention_metadata bounds (0 = unknown)
    max_kv: int
    qk_output: int


def prepare(inputs: Mapping[str, Any], attributes: Mapping[str, Any], *, outputs: Sequence[str] | None,
            validate: bool) -> Prepared:
    if validate:
        from pagedkit.validators.checks import require_valid_inputs

        require_valid_inputs(inputs, attributes, op_type="PagedAttention", outputs=outputs)
    x = {k: v for k, v in inputs.items() if v is not None}
    a = _DEFAULTS | dict(attributes)
    nh, hkv = int(a["num_heads"]), int(a["kv_num_heads"])
    latent = a["kv_cache_layout"] == "LATENT"
    query = x["query"]
    packed = not latent and "key" not in x and "value" not in x
    d = query.shape[1] // (nh + 2 * hkv if packed else nh) if not latent else x["key"].shape[1] // hkv
    dv = (int(a["v_head_size"]) or d) if latent else d
    kc, vc = x["key_cache"], x.get("value_cache")
    kf = common.side_format(kc, str(a["k_cache_dtype"]), str(a["k_quant_type"]), "key_cache")
    vf = None if latent else common.side_format(vc, str(a["v_cache_dtype"]), str(a["v_quant_type"]), "value_cache")
    k_scale = common.static_scale_vector(x.get("k_scale"), hkv, d) if kf.scale in (
        common.SCALE_TENSOR, common.SCALE_CHANNEL) else None
    v_scale = common.static_scale_vector(x.get("v_scale"), hkv, d) if vf is not None and vf.scale in (
        common.SCALE_TENSOR, common.SCALE_CHANNEL) else None
    max_q, max_kv = _bounds(x.get("attention_metadata"))
    qk_output = int(a["qk_output"])
    if outputs is not None and "output_qk" in outputs and not qk_output:
        raise ValueError("output 'output_qk' requested but attribute 'qk_output' is 0 (expected 1 or 2)")
    return Prepared(x, a, nh, hkv, d, dv, latent, kf, vf, k_scale, v_scale, max_q, max_kv, qk_output)


def write(p: Prepared) -> torch.Tensor:
    """The cache-write prologue (one launch): K/V of the step into the caches; returns q [N, H, D] (QK-norm,
    RoPE, rotation applied). Under a run scope promising distinct slots (kernels/scope.py: the engine's and
    the generator's plans) the write skips its duplicate-slot handling."""
    from ..scope import distinct_slots
    from . import ops

    x, a, kf, vf = p.x, p.a, p.kf, p.vf
    return ops.write_kv(
        x["query"], x.get("key"), x.get("value"), x["cumulative_sequence_length"], x["past_seqlens"],
        x["block_table"], x["key_cache"], x.get("value_cache"), x.get("slot_mapping"), x.get("query_positions"),
        x.get("cos_cache"), x.get("sin_cache"), x.get("q_norm_weight"), x.get("k_norm_weight"), p.k_scale,
        p.v_scale, x.get("k_scale_cache"), x.get("v_scale_cache"),
        num_heads=p.nh, kv_num_heads=p.hkv, head_size=p.d, k_fmt=kf.fmt, k_scale_mode=kf.scale,
        v_fmt=-1 if vf is None else vf.fmt, v_scale_mode=-1 if vf is None else vf.scale,
        rotary=bool(int(a["do_rotary"])), rotary_interleaved=bool(int(a["rotary_interleaved"])),
        rotary_offset=int(a["rotary_offset"]), qk_norm_epsilon=float(a["qk_norm_epsilon"]),
        qk_rotation=bool(int(a["qk_rotation"])), v_rotation=bool(int(a["v_rotation"])), latent=p.latent,
        unique_slots=distinct_slots())


def results(p: Prepared, out: torch.Tensor, qk: torch.Tensor | None,
            outputs: Sequence[str] | None) -> dict[str, torch.Tensor]:
    """The node's outputs by contract name (caches: the input buffers, updated in place)."""
    x = p.x
    result = {"output": out, "key_cache_out": x["key_cache"]}
    if x.get("value_cache") is not None:
        result["value_cache_out"] = x["value_cache"]
    for side in ("k", "v"):
        if f"{side}_scale_cache" in x:
            result[f"{side}_scale_cache_out"] = x[f"{side}_scale_cache"]
    if p.qk_output:
        result["output_qk"] = qk
    if outputs is not None:
        want = set(outputs)
        result = {n: t for n, t in result.items() if n in want}
    return result


def run(inputs: Mapping[str, Any], *, outputs: Sequence[str] | None, validate: bool, fused_mla: bool,
        **attributes: Any) -> dict[str, torch.Tensor]:
    """The cache-write prologue then the attention: the general split-KV kernel, or with fused_mla (variant
    triton_mla, LATENT only) the fused MLA kernel (mla.py)."""
    p = prepare(inputs, attributes, outputs=outputs, validate=validate)
    if fused_mla and not p.latent:
        raise NotImplementedError("triton_mla serves kv_cache_layout LATENT only")
    return results(p, *attend(p, write(p), fused_mla=fused_mla), outputs)


def attend(p: Prepared, q: torch.Tensor, *, fused_mla: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention over the block table (after `write`): (output [N, H*Dv], output_qk or [0])."""
    from . import ops

    x, a, kf, vf = p.x, p.a, p.kf, p.vf
    return ops.paged_decode(
        q, x["key_cache"], x.get("value_cache"), x["cumulative_sequence_length"], x["past_seqlens"],
        x["block_table"], p.k_scale, p.v_scale, x.get("k_scale_cache"), x.get("v_scale_cache"),
        x.get("query_positions"), x.get("head_sink"), x.get("attention_bias"),
        k_fmt=kf.fmt, k_scale_mode=kf.scale, v_fmt=-1 if vf is None else vf.fmt,
        v_scale_mode=-1 if vf is None else vf.scale, num_heads=p.nh, kv_num_heads=p.hkv, head_size=p.d,
        v_head_size=p.dv, scale=default_scale(float(a["scale"]), p.d), softcap=float(a["softcap"]),
        local_window_size=int(a["local_window_size"]), is_causal=bool(int(a["is_causal"])),
        qk_output=p.qk_output, v_rotation=bool(int(a["v_rotation"])) and not p.latent,
        max_query_len=p.max_q, max_kv_len=p.max_kv, fused_mla=fused_mla)
