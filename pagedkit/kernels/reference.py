"""The PagedAttention reference kernel: small, loop-based, obviously correct (the oracle).

Semantics: contract-decisions.md §2, §3, §7 and the design doc §4-§12. One call does, in order:
1. prologue for every token of the step: [packed QKV split] -> QK-norm -> RoPE -> Hadamard rotation
   (Q/K with qk_rotation, V with v_rotation); Q is then held as a T tensor, like ORT's prologue workspace;
2. cache write for every token: quantize and store K/V (and PER_TOKEN scales) at its slot
   (slot_mapping, or derived from past_seqlens + block_table; -1 or an unmapped block writes nothing);
3. attention per sequence over its context read back (dequantized) through its block_table row, so new
   tokens are seen exactly as cached, quantization error included. Unmapped blocks are masked.
Everything is computed in float32 (float64 on request); output 0 is returned in T, output_qk in float32.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from pagedkit.validators.checks import require_valid_inputs
from pagedkit.validators.contract import PAGED_ATTENTION

from .attention_math import apply_rope, attend, default_scale, rms_norm_heads
from .quant import hadamard
from .reference_cache import make_side

_NP_VIEWS = {"bfloat16": (np.uint16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn)}


def as_torch(x: Any) -> torch.Tensor:
    """A torch tensor as is; a numpy array (incl. ml_dtypes bfloat16 / float8_e4m3fn) as a new tensor."""
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype.name in _NP_VIEWS:
        raw, dt = _NP_VIEWS[arr.dtype.name]
        return torch.from_numpy(arr.view(raw).copy()).view(dt)
    return torch.from_numpy(arr.copy())


def _need(cond: bool, where: str, msg: str) -> None:
    """Last-line guard for run-time values that would otherwise index out of range."""
    if not cond:
        raise ValueError(f"PagedAttention: {where}: {msg}")


def paged_attention(
    inputs: Mapping[str, Any],
    *,
    outputs: Sequence[str] | None = None,
    compute_dtype: torch.dtype = torch.float32,
    output_dtype: torch.dtype | None = None,
    **attributes: Any,
) -> dict[str, torch.Tensor]:
    """Run com.microsoft::PagedAttention on concrete inputs keyed by ONNX input name (None = absent).

    attributes are the node's attributes (contract defaults fill the rest). outputs names the requested
    outputs (validated; the result is filtered to them); None returns every output the call produces:
    "output" [token_count, num_heads * v_head_size] in T (or output_dtype), "key_cache_out" /
    "value_cache_out" (the cache tensors, updated in place; numpy caches are copied first),
    "k_scale_cache_out" / "v_scale_cache_out" with PER_TOKEN scale caches, and "output_qk"
    [num_heads, token_count, block_table.shape[1] * block_size] float32 when qk_output != 0.
    Raises pagedkit.validators.ValidationError listing every contract violation.
    """
    require_valid_inputs(inputs, attributes, op_type="PagedAttention", outputs=outputs)
    a = PAGED_ATTENTION.defaults() | dict(attributes)
    x = {k: as_torch(v) for k, v in inputs.items() if v is not None}
    cdt = compute_dtype

    num_heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    latent = a["kv_cache_layout"] == "LATENT"
    query = x["query"]  # [N, H*D] or packed [N, (H + 2*Hkv)*D]
    t_dtype, n_tok = query.dtype, query.shape[0]
    packed = not latent and "key" not in x and "value" not in x
    head_size = query.shape[1] // (num_heads + 2 * kv_heads if packed else num_heads)
    v_head = (int(a["v_head_size"]) or head_size) if latent else head_size  # effective_v_head_size

    q_all = query.to(cdt)
    if packed:
        q, k, v = q_all.split([num_heads * head_size, kv_heads * head_size, kv_heads * head_size], dim=1)
    else:
        q, k = q_all, x["key"].to(cdt)
        v = None if latent else x["value"].to(cdt)
    q = q.reshape(n_tok, num_heads, head_size)  # [N, H, D]
    k = k.reshape(n_tok, kv_heads, head_size)  # [N, Hkv, D]
    v = None if v is None else v.reshape(n_tok, kv_heads, head_size)

    # sequences: sequence b owns tokens [csl[b], csl[b+1]); token j of it sits at position past[b] + j
    csl = x["cumulative_sequence_length"].long().tolist()
    past = x["past_seqlens"].long().tolist()
    block_table = x["block_table"].long()  # [B, MB]
    _need(len(csl) == len(past) + 1 and csl[-1] == n_tok, "input 'cumulative_sequence_length'",
          f"expected batch_size + 1 = {len(past) + 1} entries ending at token_count {n_tok}, got {csl}")
    seq_pos = torch.zeros(n_tok, dtype=torch.long)  # derived position of each token
    for b in range(len(past)):
        seq_pos[csl[b]:csl[b + 1]] = past[b] + torch.arange(csl[b + 1] - csl[b])
    positions = x["query_positions"].long() if "query_positions" in x else seq_pos  # RoPE + masks

    # 1. prologue: QK-norm -> RoPE -> rotation
    if "q_norm_weight" in x:
        eps = float(a["qk_norm_epsilon"])
        q = rms_norm_heads(q, x["q_norm_weight"].to(cdt), eps)
        k = rms_norm_heads(k, x["k_norm_weight"].to(cdt), eps)
    if int(a["do_rotary"]):
        cos, sin = x["cos_cache"].to(cdt), x["sin_cache"].to(cdt)
        _need(n_tok == 0 or int(positions.max()) < cos.shape[0], "input 'cos_cache'",
              f"has {cos.shape[0]} positions, a token needs position {int(positions.max()) if n_tok else 0}")
        inter, offset = bool(int(a["rotary_interleaved"])), int(a["rotary_offset"])
        q = apply_rope(q, positions, cos, sin, inter, offset)
        k = apply_rope(k, positions, cos, sin, inter, offset)
    if int(a["qk_rotation"]):
        q, k = hadamard(q, "head_size"), hadamard(k, "head_size")
    if v is not None and int(a["v_rotation"]):
        v = hadamard(v, "head_size")
    q = q.to(t_dtype).to(cdt)  # the prologue's Q is a T tensor

    # 2. cache writes (all tokens of the step before any attention)
    kside = make_side(x, a, "k", kv_heads, head_size, cdt)
    vside = None if latent else make_side(x, a, "v", kv_heads, head_size, cdt)
    slots = _slots(x, block_table, past, csl, seq_pos, kside.num_blocks, kside.block_size)
    kside.write(slots, k)
    if vside is not None:
        vside.write(slots, v)

    # 3. attention per sequence, reading the context back through the cache
    bs, mb = kside.block_size, block_table.shape[1]
    capacity = mb * bs
    scale = default_scale(float(a["scale"]), head_size)
    softcap, window = float(a["softcap"]), int(a["local_window_size"])
    causal, qk_mode = bool(int(a["is_causal"])), int(a["qk_output"])
    sink = x["head_sink"].to(cdt) if "head_sink" in x else None
    bias = x["attention_bias"].to(cdt) if "attention_bias" in x else None
    out = torch.zeros(n_tok, num_heads, v_head, dtype=cdt)  # [N, H, Dv]
    qk = torch.zeros(num_heads, n_tok, capacity, dtype=cdt) if qk_mode else None  # [H, N, C]
    kpos = torch.arange(capacity)
    for b in range(len(past)):
        t0, t1 = csl[b], csl[b + 1]
        if t1 == t0:
            continue
        extent = past[b] + (t1 - t0)
        _need(extent <= capacity, "input 'block_table'",
              f"sequence {b} holds {extent} tokens but block_table covers {capacity} ({mb} blocks of {bs})")
        keys, mapped = kside.read(block_table[b], cdt)  # [C, Hkv, D], [C]
        values = keys[..., :v_head] if latent else vside.read(block_table[b], cdt)[0]
        qpos = positions[t0:t1, None]
        allowed = (mapped & (kpos < extent)).expand(t1 - t0, capacity).clone()  # [n, C]
        if causal:
            allowed &= kpos[None, :] <= qpos
        if window > 0:
            allowed &= kpos[None, :] >= qpos - window + 1
        bias_b = None if bias is None else _bias_rows(bias, b, t1 - t0, extent, capacity)
        o, s, p = attend(q[t0:t1], keys, values, allowed, scale, softcap, bias_b, sink)
        out[t0:t1] = o
        if qk is not None:
            qk[:, t0:t1] = s if qk_mode == 1 else p
    if vside is not None and int(a["v_rotation"]):
        out = hadamard(out, "head_size")  # H^T == H

    result = {"output": out.reshape(n_tok, num_heads * v_head).to(output_dtype or t_dtype),
              "key_cache_out": kside.cache}
    if vside is not None:
        result["value_cache_out"] = vside.cache
    for prefix in ("k", "v"):
        if f"{prefix}_scale_cache" in x:
            result[f"{prefix}_scale_cache_out"] = x[f"{prefix}_scale_cache"]
    if qk_mode:
        result["output_qk"] = qk.to(torch.float32)
    if outputs is not None:
        result = {name: t for name, t in result.items() if name in set(outputs)}
    return result


def _slots(x, block_table, past, csl, seq_pos, num_blocks: int, block_size: int) -> list[int]:
    """Write slot of each token: slot_mapping, or block_table[b][p // BS] * BS + p % BS (-1: no write)."""
    total = num_blocks * block_size
    if "slot_mapping" in x:
        slots = x["slot_mapping"].long().tolist()
        bad = [s for s in slots if s < -1 or s >= total]
        _need(not bad, "input 'slot_mapping'", f"entries should be -1 or in [0, {total}), got {bad[:4]}")
        return slots
    slots = []
    for b in range(len(past)):
        for t in range(csl[b], csl[b + 1]):
            p = int(seq_pos[t])
            _need(p // block_size < block_table.shape[1], "input 'block_table'",
                  f"sequence {b} writes position {p} but has {block_table.shape[1]} blocks of {block_size}")
            blk = int(block_table[b, p // block_size])
            slots.append(blk * block_size + p % block_size if 0 <= blk < num_blocks else -1)
    return slots


def _bias_rows(bias: torch.Tensor, b: int, n: int, extent: int, capacity: int) -> torch.Tensor:
    """attention_bias [B or 1, H or 1, Qc, Kc] -> [H or 1, n, capacity] for sequence b (j < n, k < C)."""
    qc, kc = bias.shape[2], bias.shape[3]
    _need(qc >= n and kc >= extent, "input 'attention_bias'",
          f"capacities (query {qc}, context {kc}) should cover sequence {b}'s {n} queries and {extent} keys")
    rows = bias[b if bias.shape[0] > 1 else 0, :, :n, :capacity]
    if rows.shape[-1] < capacity:  # positions beyond the bias capacity are beyond the extent: masked
        rows = torch.nn.functional.pad(rows, (0, capacity - rows.shape[-1]))
    return rows
