"""GroupQueryAttention reference: onnxruntime's semantics, loop-based, computed in float32 (float64 on request).

Per batch entry b (ORT 1.32.0 schema): T = seqlens_k[b] + 1 tokens are cached after the step,
Q = query_seqlens[b] (default min(S, T)) query rows [0, Q) are valid, P = T - Q tokens were cached
before, and query row s sits at absolute position P + s (causal mask, window, default RoPE position).
key/value with 0 rows ("shared KV", ORT CPU accepts it): nothing is appended, the past holds all T.
Pipeline: split packed QKV -> QK-norm -> RoPE -> quantize/store the new K/V (gqa/cache.py) -> attend over
the cached positions (read back from the cache, dequantized) -> output [B, S, H*D]. Output rows
[Q, S) are unspecified by the operator; the reference leaves them 0.

Where onnxruntime's CPU kernel defines details (checked in tests/test_gqa_vs_ort.py), we follow it:
- attention_bias is added AFTER softcap: softcap * tanh(scale * qk / softcap) + bias (also what
  onnxruntime-gpu 1.31.1's CUDA GQA does; PagedAttention's contract adds it before softcap);
- local_window_size W admits W positions including the current one;
- head_sink is used whatever smooth_softmax says (smooth_softmax=1 adds exp(0) only without a sink);
- a first prompt (no query_seqlens and S == total_sequence_length) reads only position_ids[0, 0]:
  row s of every batch entry is rotated at position_ids[0, 0] + s (ORT's CUDA kernel reads them all);
- output_qk (B, H, S, total_sequence_length) holds softcap(scaled scores) + bias (qk_output=1) or the
  probabilities (2), indexed by absolute key position, 0 at masked / non-resident / beyond-T positions;
- quantized caches: the new K/V are quantized (rint, ties to even; int4 nibble q + 8, even channel
  low) and attention reads them back dequantized, like every cached position.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

from ...validators.checks import require_valid_inputs
from ...validators.contract import GROUP_QUERY_ATTENTION as _C
from ..attention_math import apply_rope, attend, default_scale, rms_norm_heads
from ..variant import OP_FEATURES, KernelVariant
from .cache import GqaCacheSide, KVLayout
from ..paged.reference import as_torch

_OP = "GroupQueryAttention"

VARIANT = KernelVariant(
    name="reference",
    op=_OP,
    entry=f"{__name__}:group_query_attention",
    devices=("cpu", "cuda"),  # cuda: on CPU copies, only as the reference fallback (contract-decisions §9)
    dtypes=("float16", "bfloat16", "float"),
    capturable=False,
    features=OP_FEATURES[_OP],
    plans=("mixed",),
    stages_on_cpu=True,
    description="onnxruntime's GroupQueryAttention semantics, loop-based, in float32; presents are new tensors "
                "(the runtime copies them into a shared past buffer). Computed on the CPU.",
    not_capturable_because="runs on the host: CPU copies of every input, Python loops over the batch",
)


def _attrs(attributes: Mapping) -> dict:
    a = {x.name: x.default for x in _C.attributes}
    a.update({k: (v.decode() if isinstance(v, bytes) else v) for k, v in attributes.items()})
    return a


def _split_qkv(x: dict, num_heads: int, kv_num_heads: int, cd: torch.dtype):
    """query [B, S, H*D] (+ key/value [B, S, Hkv*D]) or packed [B, S, (H + 2*Hkv)*D] -> q [B, S, H, D],
    k / v [B, S, Hkv, D] in the compute dtype."""
    query = x["query"].to(cd, copy=True)  # RoPE writes rows in place: never into the caller's tensor
    b, s, width = query.shape
    if x["key"] is None:
        d = width // (num_heads + 2 * kv_num_heads)
        q, k, v = query.split([num_heads * d, kv_num_heads * d, kv_num_heads * d], dim=-1)
    else:
        d = width // num_heads
        q, k, v = query, x["key"].to(cd, copy=True), x["value"].to(cd, copy=True)
    kv_s = k.shape[1]  # S, or 0: no new K/V ("shared KV": the query attends to the past only)
    return (q.reshape(b, s, num_heads, d), k.reshape(b, kv_s, kv_num_heads, d), v.reshape(b, kv_s, kv_num_heads, d))


def group_query_attention(
    inputs: Mapping[str, torch.Tensor | np.ndarray | None],
    *,
    outputs=None,
    compute_dtype: torch.dtype = torch.float32,
    validate: bool = True,
    **attributes,
) -> dict[str, torch.Tensor]:
    """com.microsoft::GroupQueryAttention on concrete tensors, keyed by ONNX names.

    Returns "output" [B, S, H*D] (dtype T), "present_key" / "present_value" [B, Hkv, C, D or (D+1)/2]
    (the cache dtype; C = past capacity for a windowed cache, else max(past capacity, total)) and
    "output_qk" [B, H, S, total_sequence_length] (dtype T) when qk_output != 0; only those named in
    `outputs` when it is given. Inputs are never modified (the presents are new tensors).
    Raises pagedkit.validators.ValidationError listing every contract violation first (validate=False skips
    the validator for a node validated already; out-of-range indices then fail in torch indexing).
    """
    if validate:
        require_valid_inputs(inputs, attributes, op_type=_OP, outputs=outputs)
    x = {n: None if inputs.get(n) is None else as_torch(inputs[n]) for n in _C.input_names}
    device = x["query"].device  # computed on the CPU, returned on the query's device
    x = {n: None if t is None else t.cpu() for n, t in x.items()}
    a = _attrs(attributes)
    cd = compute_dtype
    h, hkv = int(a["num_heads"]), int(a["kv_num_heads"])
    out_dtype = x["query"].dtype

    q, k_new, v_new = _split_qkv(x, h, hkv, cd)  # [B, S, H, D], [B, S, Hkv, D]
    bsz, s, _, d = q.shape
    total = int(x["total_sequence_length"].reshape(-1)[0])
    t_len = x["seqlens_k"].long() + 1  # T per batch entry
    q_len = (x["query_seqlens"].long() if x["query_seqlens"] is not None
             else torch.minimum(t_len, torch.tensor(s)))  # Q per batch entry
    p_len = t_len - q_len  # P: position of query row 0
    kv_len = q_len if k_new.shape[1] else torch.zeros_like(q_len)  # new K/V rows appended per entry

    # QK-norm (before RoPE), per head over channels.
    if x["q_norm_weight"] is not None:
        eq = a["q_norm_epsilon"] if a["q_norm_epsilon"] is not None else a["qk_norm_epsilon"]
        ek = a["k_norm_epsilon"] if a["k_norm_epsilon"] is not None else a["qk_norm_epsilon"]
        q = rms_norm_heads(q, x["q_norm_weight"].to(cd), float(eq))
        k_new = rms_norm_heads(k_new, x["k_norm_weight"].to(cd), float(ek))

    # RoPE at absolute positions P + s, or position_ids [B, S] when given (valid rows only). In a first
    # prompt (no query_seqlens, S == total_sequence_length) ORT reads only position_ids[0, 0]: row s of
    # every batch entry gets position_ids[0, 0] + s.
    if a["do_rotary"]:
        cos, sin = x["cos_cache"].to(cd), x["sin_cache"].to(cd)
        pos_ids = x["position_ids"]
        if pos_ids is not None and x["query_seqlens"] is None and s == total:
            pos_ids = (pos_ids.reshape(-1)[0] + torch.arange(s)).expand(bsz, s)
        for bi in range(bsz):
            n = int(q_len[bi])
            if pos_ids is not None:
                pos = pos_ids[bi, :n].long()
            else:
                pos = torch.arange(n) + int(p_len[bi])
            q[bi, :n] = apply_rope(q[bi, :n], pos, cos, sin, bool(a["rotary_interleaved"]))
            if k_new.shape[1]:
                k_new[bi, :n] = apply_rope(k_new[bi, :n], pos, cos, sin, bool(a["rotary_interleaved"]))

    layout = KVLayout.of(x, a, total)
    bits = int(a["kv_cache_bit_width"] or 0)
    k_side = GqaCacheSide.of(x["past_key"], x["k_scale"], a["k_quant_type"], bits, out_dtype, d)
    v_side = GqaCacheSide.of(x["past_value"], x["v_scale"], a["v_quant_type"], bits, out_dtype, d)
    present_k, keys, first = k_side.update(layout, k_new, t_len, kv_len, cd)  # keys[b]: [n_b, Hkv, D]
    present_v, values, _ = v_side.update(layout, v_new, t_len, kv_len, cd)

    scale = default_scale(a["scale"], d)
    bias = x["attention_bias"].to(cd) if x["attention_bias"] is not None else None
    sink = x["head_sink"].to(cd) if x["head_sink"] is not None else None
    window = int(a["local_window_size"])
    output = torch.zeros(bsz, s, h, d, dtype=cd)
    qk = torch.zeros(bsz, h, s, total, dtype=cd) if a["qk_output"] else None
    for bi in range(bsz):
        n, p0, f0 = int(q_len[bi]), int(p_len[bi]), int(first[bi])
        if n == 0:
            continue
        key_pos = torch.arange(keys[bi].shape[0]) + f0  # absolute position of every readable key
        q_pos = torch.arange(n) + p0
        allowed = (key_pos[None, :] < int(t_len[bi])).expand(n, -1)
        if a["causal"]:
            allowed = allowed & (key_pos[None, :] <= q_pos[:, None])
        if window > 0:
            allowed = allowed & (key_pos[None, :] >= q_pos[:, None] - window + 1)
        bias_b = None
        if bias is not None:
            bias_b = bias[bi if bias.shape[0] > 1 else 0][:, :n][..., key_pos]  # [H or 1, n, n_keys]
        o, scores, probs = attend(q[bi, :n], keys[bi], values[bi], allowed, scale, float(a["softcap"]),
                                  bias_b, sink, smooth=int(a["smooth_softmax"]) == 1, bias_after_softcap=True)
        output[bi, :n] = o
        if qk is not None:
            qk[bi][:, :n, key_pos] = scores if int(a["qk_output"]) == 1 else probs

    result = {"output": output.reshape(bsz, s, h * d).to(out_dtype).to(device),
              "present_key": present_k.to(device), "present_value": present_v.to(device)}
    if qk is not None:
        result["output_qk"] = qk.to(out_dtype).to(device)
    return result if outputs is None else {k: v for k, v in result.items() if k in set(outputs)}
