"""The PagedAttention reference kernel: small, loop-based, obviously correct (the oracle).

Semantics: contract-decisions.md §2, §3, §7 and the design doc §4-§12. One call does, in order:
1. prologue for every token of the step: [packed QKV split] -> QK-norm -> RoPE -> Hadamard rotation
   (Q/K with qk_rotation, V with v_rotation); Q is then held as a T tensor, like ORT's prologue workspace;
2. cache write for every token: quantize and store K/V (and PER_TOKEN scales) at its slot
   (slot_mapping, or derived from past_seqlens + block_table; -1 or an unmapped block writes nothing);
3. attention per sequence over its context read back (dequantized) through its block_table row, so new
   tokens are seen exactly as cached, quantization error included. Unmapped blocks are masked.
Everything is computed in float32 (float64 on request); output 0 is returned in T, output_qk in float32.
Steps 1 and 2 (and the output assembly) live in prologue.py, shared with the vectorized torch_sdpa;
the cache writes here use the loop PagedCacheSide.write.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from ..attention_math import attend, default_scale
from ..variant import OP_FEATURES, KernelVariant
from .extents import check_extents
from .prologue import as_torch, prepare

__all__ = ["VARIANT", "as_torch", "paged_attention"]  # as_torch: gqa/reference.py imports it from here

VARIANT = KernelVariant(
    name="reference",
    op="PagedAttention",
    entry=f"{__name__}:paged_attention",
    devices=("cpu", "cuda"),  # cuda: on CPU copies, only as the reference fallback (contract-decisions §9)
    dtypes=("float16", "bfloat16"),
    capturable=False,
    features=OP_FEATURES["PagedAttention"],
    plans=("mixed",),
    stages_on_cpu=True,
    description="Loop-based oracle: per sequence, per query row, in float32 (float64 on request). On a CUDA "
                "session it runs on CPU copies and writes the caches back (reference fallback).",
    not_capturable_because="runs on the host: CPU copies of every input, Python loops over sequences",
)


def paged_attention(
    inputs: Mapping[str, Any],
    *,
    outputs: Sequence[str] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype | None = None,
    validate: bool = True,
    **attributes: Any,
) -> dict[str, torch.Tensor]:
    """Run com.microsoft::PagedAttention on concrete inputs keyed by ONNX input name (None = absent).

    attributes are the node's attributes (contract defaults fill the rest). outputs names the requested
    outputs (validated; the result is filtered to them); None returns every output the call produces:
    "output" [token_count, num_heads * v_head_size] in T (or output_dtype), "key_cache_out" /
    "value_cache_out" (the cache tensors, updated in place; numpy caches are copied first),
    "k_scale_cache_out" / "v_scale_cache_out" with PER_TOKEN scale caches, and "output_qk"
    [num_heads, token_count, block_table.shape[1] * block_size] float32 when qk_output != 0.
    Raises pagedkit.validators.ValidationError listing every contract violation. validate=False skips the
    contract validator for a node validated already (a session validates at creation); the index guards stay.
    """
    # 1.-2. prologue and cache writes (prologue.py; the loop write PagedCacheSide.write)
    if not validate:
        check_extents(inputs)  # the validator's guard that matters before the cache writes
    step = prepare(inputs, attributes, outputs, compute_dtype, validate=validate)
    a, q, cdt = step.attrs, step.q, compute_dtype
    csl, past, block_table = step.csl, step.past, step.block_table
    kside, vside, positions = step.kside, step.vside, step.positions
    n_tok, num_heads, v_head, latent = q.shape[0], step.num_heads, step.v_head, step.latent

    # 3. attention per sequence, reading the context back through the cache
    bs, mb = kside.block_size, block_table.shape[1]
    capacity = mb * bs
    scale = default_scale(float(a["scale"]), step.head_size)
    softcap, window = float(a["softcap"]), int(a["local_window_size"])
    causal, qk_mode = bool(int(a["is_causal"])), int(a["qk_output"])
    sink = step.x["head_sink"].to(cdt) if "head_sink" in step.x else None
    out = torch.zeros(n_tok, num_heads, v_head, dtype=cdt, device=q.device)  # [N, H, Dv]
    qk = torch.zeros(num_heads, n_tok, capacity, dtype=cdt, device=q.device) if qk_mode else None  # [H, N, C]
    kpos = torch.arange(capacity, device=q.device)
    for b in range(len(past)):
        t0, t1 = csl[b], csl[b + 1]
        if t1 == t0:
            continue
        extent = step.extent(b)  # past[b] + (t1 - t0), checked against the capacity
        keys, mapped = kside.read(block_table[b], cdt)  # [C, Hkv, D], [C]
        values = keys[..., :v_head] if latent else vside.read(block_table[b], cdt)[0]
        qpos = positions[t0:t1, None]
        allowed = (mapped & (kpos < extent)).expand(t1 - t0, capacity).clone()  # [n, C]
        if causal:
            allowed &= kpos[None, :] <= qpos
        if window > 0:
            allowed &= kpos[None, :] >= qpos - window + 1
        o, s, p = attend(q[t0:t1], keys, values, allowed, scale, softcap, step.bias_rows(b), sink)
        out[t0:t1] = o
        if qk is not None:
            qk[:, t0:t1] = s if qk_mode == 1 else p
    return step.finish(out, qk, outputs, output_dtype)
