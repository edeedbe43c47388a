"""Fused MLA decode on Triton (variant "triton_mla"): PagedAttention with kv_cache_layout LATENT (DeepSeek's
absorbed MLA: one latent cache [NB, BS, 1, DL + DR], V = its leading DL channels) for decode-shaped steps.

The cache write is triton_paged's prologue (`cache_write.write_kv`); the attention is `_mla_kernels._mla_kernel`
(launched by `mla_decode.mla_decode`, which ops.py's `pagedkit::paged_decode` calls for fused_mla):
the DL latent channels and the DR rope channels as two dot products (no padding of 576 to 1024 as the general
kernel does), each KV tile loaded once for QK^T and PV, all query heads of a sequence in one program (up to 64
heads; more in sub-groups), split-KV over the context with triton_paged's reduce kernel. float16 / bfloat16 /
int8 / fp8 caches, PER_TENSOR or PER_TOKEN scales (one scale for K and V, as LATENT has it).

Plans: "decode" only (a few query tokens per sequence): the kernel is exact for any step, but a long prompt's
queries would each re-read the latent cache, so sessions pick it from the plan hint and prefills keep
triton_paged. No host syncs, no host reads of device values: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..variant import KernelVariant
from . import common
from .mla_decode import mla_decode, split_channels  # noqa: F401 (mla_decode re-exported: tests, benchmarks)

NAME = "triton_mla"
_CACHE_FORMATS = ("float16", "bfloat16", "int8", "float8e4m3fn")


def _supports(info: Any) -> str | None:
    if not common.HAVE_TRITON:
        return "triton is not installed (pip install 'pagedkit[gpu]')"
    if info.layout != "LATENT":
        return "serves kv_cache_layout LATENT only"
    if info.head_size is not None and info.v_head_size is not None:
        split = split_channels(info.head_size, info.v_head_size)
        if isinstance(split, str):
            return split
        if split[0] > 512 or split[1] > 128:
            return f"latent / rope channels {split} beyond (512, 128)"
    fmt = info.k_cache_format
    if fmt is not None and fmt not in _CACHE_FORMATS:
        return f"cache format {fmt} (serves {', '.join(_CACHE_FORMATS)})"
    if fmt in ("float16", "bfloat16") and info.t_dtype is not None and fmt != info.t_dtype:
        return f"a {fmt} cache with T {info.t_dtype} (float caches in T only)"
    if info.attr("k_quant_type") == "PER_CHANNEL":
        return "PER_CHANNEL scales (serves NONE, PER_TENSOR, PER_TOKEN)"
    return None


VARIANT = KernelVariant(
    name=NAME,
    op="PagedAttention",
    entry=f"{__name__}:paged_attention",
    devices=("cuda",),
    dtypes=("float16", "bfloat16"),
    capturable=True,
    features=("latent_cache", "rotary", "local_window", "non_causal", "slot_mapping", "query_positions",
              "attention_metadata", "int8_cache", "fp8_cache", "per_token_scales"),
    supports=_supports,
    plans=("decode",),
    description="Triton fused MLA decode (LATENT): the latent and rope channels as two dot products, each KV tile "
                "read once for QK^T and PV, every query head of a sequence in one program, split-KV with a reduce; "
                "triton_paged's cache-write prologue. CUDA-graph capturable.",
    limits="LATENT only; v_head_size and head_size - v_head_size powers of two (<= 512 / 128); float caches in T, "
           "int8 or fp8 with NONE / PER_TENSOR / PER_TOKEN; decode plans (prefills keep triton_paged); needs triton",
)


def supports(info: Any) -> str | None:
    return VARIANT.refusal(info)


def paged_attention(inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None, validate: bool = True,
                    **attributes: Any) -> dict[str, torch.Tensor]:
    """com.microsoft::PagedAttention (LATENT) with the fused MLA attention; same results as the reference."""
    from .paged import run

    return run(inputs, outputs=outputs, validate=validate, fused_mla=True, **attributes)


