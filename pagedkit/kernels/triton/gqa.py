"""GroupQueryAttention on the PagedAttention Triton kernels (variant "triton_gqa"): one kernel, two accessors
(design §14.3). The same cache-write prologue (`cache_write.write_kv`) and split-KV attention
(`decode.paged_decode`) run over GQA's contiguous BNSH caches instead of the block table, so the two operators
cannot drift.

Layouts: query [B, S, H*D] (packed [B, S, (H + 2*Hkv)*D]), key / value [B, S, Hkv*D] in T (float16 /
bfloat16); past_key / past_value [B, Hkv, Cp, Dc] (Dc = D, or D / 2 uint8 bytes for int4); output
[B, S, H*D]; present_* [B, Hkv, C, Dc] with C = max(Cp, total_sequence_length): the past buffer itself,
updated in place, when Cp >= total (onnxruntime's shared past/present buffer), else a new tensor holding the
past rows; output_qk [B, H, S, total] in T.

Per batch entry b (the reference's semantics, kernels/gqa/reference.py): T_b = seqlens_k[b] + 1, Q_b =
query_seqlens[b] or min(S, T_b) valid rows, P_b = T_b - Q_b cached before; row s sits at position P_b + s.
All of it is computed on the device (no host reads): the write goes through an explicit slot per row (row s
of b to flat row b * Hkv * C + P_b + s of a [rows, 1, Hkv, Dc] view of the cache, -1 for padding rows); RoPE
positions are position_ids (a first prompt, no query_seqlens and S == total, reads position_ids[0, 0] + s, as
onnxruntime's CPU kernel does) or P_b + s. The attention reads the BNSH cache through virtual blocks
(decode.py `bnsh`), rows of a padded batch (`row_pad`), attention_bias after softcap, smooth_softmax as a
zero head sink. Output rows [Q_b, S) are zero.

First prompts (S == total_sequence_length, no query_seqlens: P_b = 0 for every entry, host facts only), causal,
on float caches in T and without softcap / window / sinks / smooth_softmax / bias / output_qk, take torch's
fused attention instead (cuDNN, else FlashAttention-2: `sdpa_prefill.fused_sdpa`) over the rows the prologue
wrote; `LAST_ROUTE` says which attention the last call ran ("triton", "cudnn", "flash", "math" on CPU tensors).

sliding_window_cache=1 (windowed past / present buffers) runs in gqa_window.py on the same kernels; the pieces
both share (presents, index constants, the cache-write prologue, sink, results) are in gqa_common.py.

Refuses (static): sliding_window_cache=1 with qk_output, key / value with 0 rows (shared KV), T float32, a float
cache of another type than T, head_size > 256.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from pagedkit.validators.contract import GROUP_QUERY_ATTENTION as _C

from ..attention_math import default_scale
from ..variant import OP_FEATURES, KernelVariant
from . import common
from .gqa_common import _constants, _results, flat_rows, presents, sink, write

NAME = "triton_gqa"
LAST_ROUTE: str | None = None  # what the last call's attention ran on: "triton", or a first prompt's "cudnn" /
# "flash" / "math" (torch's fused attention, see _first_prompt)
MAX_HEAD_SIZE = 256
_DEFAULTS = {a.name: a.default for a in _C.attributes}
_FEATURES = tuple(f for f in OP_FEATURES["GroupQueryAttention"] if f != "shared_kv")


def _supports(info: Any) -> str | None:
    if not common.HAVE_TRITON:
        return "triton is not installed (pip install 'pagedkit[gpu]')"
    if int(info.attr("sliding_window_cache") or 0) and int(info.attr("qk_output") or 0):
        return "sliding_window_cache=1 with qk_output is served by the reference only"
    if info.head_size is not None and info.head_size > MAX_HEAD_SIZE:
        return f"head_size {info.head_size} > {MAX_HEAD_SIZE}"
    cache = info.dtypes.get("past_key")
    if str(info.attr("k_quant_type")) == "NONE" and cache is not None and info.t_dtype and cache != info.t_dtype:
        return f"a {cache} cache with T {info.t_dtype} (expected the cache in T)"
    return None


VARIANT = KernelVariant(
    name=NAME,
    op="GroupQueryAttention",
    entry=f"{__name__}:group_query_attention",
    devices=("cuda",),
    dtypes=("float16", "bfloat16"),
    capturable=True,
    features=_FEATURES,
    supports=_supports,
    plans=("mixed",),
    description="Triton: PagedAttention's cache-write prologue and split-KV attention kernels through a "
                "contiguous (BNSH) cache accessor: in-place writes into a shared past / present buffer, padded "
                "batches, attention_bias after softcap, smooth_softmax; plain causal first prompts on torch's fused "
                "attention (cuDNN, else FlashAttention-2; gqa.LAST_ROUTE); windowed caches (sliding_window_cache=1). "
                "CUDA-graph capturable.",
    limits=f"head_size <= {MAX_HEAD_SIZE}; no shared KV, no qk_output with sliding_window_cache, a float cache in "
           "T; needs triton",
)


def supports(info: Any) -> str | None:
    return VARIANT.refusal(info)


def _side(cache: torch.Tensor | None, quant_type: str, bits: int) -> common.SideFormat:
    scale = {"NONE": common.SCALE_NONE, "PER_TENSOR": common.SCALE_TENSOR, "PER_CHANNEL": common.SCALE_CHANNEL}
    if quant_type not in scale:
        raise ValueError(f"attribute 'k_quant_type' / 'v_quant_type': expected one of {sorted(scale)}, "
                         f"got {quant_type!r}")
    if quant_type == "NONE":
        return common.SideFormat(common.FMT_FLOAT, common.SCALE_NONE)
    if bits == 4:
        fmt = common.FMT_INT4
    else:
        dt = cache.dtype if cache is not None else torch.int8
        fmt = common.FMT_FP8 if dt == torch.float8_e4m3fn else common.FMT_INT8
    return common.SideFormat(fmt, scale[quant_type])


def _host_total(t: torch.Tensor) -> int:
    if t.device.type != "cpu":
        raise ValueError("input 'total_sequence_length': expected a CPU (host) tensor, got one on "
                         f"{t.device} (reading it would sync with the device)")
    return int(t.reshape(-1)[0])


def group_query_attention(inputs: Mapping[str, Any], *, outputs: Sequence[str] | None = None,
                          validate: bool = True, **attributes: Any) -> dict[str, torch.Tensor]:
    """com.microsoft::GroupQueryAttention on the Triton kernels; same results as kernels/gqa/reference.py."""
    from . import ops

    if validate:
        from pagedkit.validators.checks import require_valid_inputs

        require_valid_inputs(inputs, attributes, op_type="GroupQueryAttention", outputs=outputs)
    x = {k: v for k, v in inputs.items() if v is not None}
    a = _DEFAULTS | {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attributes.items()}
    h, hkv = int(a["num_heads"]), int(a["kv_num_heads"])
    query = x["query"]  # [B, S, W]
    bsz, s, width = query.shape
    dev, t_dtype = query.device, query.dtype
    packed = "key" not in x
    d = width // (h + 2 * hkv) if packed else width // h
    if not packed and x["key"].shape[1] == 0:
        raise NotImplementedError("triton_gqa: key / value with 0 rows (shared KV) is served by the reference")
    total = _host_total(x["total_sequence_length"])
    bits = int(a["kv_cache_bit_width"] or 0)
    past_k, past_v = x.get("past_key"), x.get("past_value")
    kf = _side(past_k, str(a["k_quant_type"]), bits)
    vf = _side(past_v, str(a["v_quant_type"]), bits)
    want = set(outputs) if outputs is not None else None
    if int(a["sliding_window_cache"]):  # windowed past / present buffers: gqa_window.py
        from .gqa_window import windowed

        _route("triton")
        return windowed(x, a, h=h, hkv=hkv, d=d, kf=kf, vf=vf, total=total, want=want)

    # presents (in place into a shared buffer) and the write slots of a flat [rows, 1, Hkv, Dc] view
    cap = max(past_k.shape[2] if past_k is not None else 0, total)
    present_k, present_v = presents(x, hkv, cap, d, kf, vf)
    flat_k, flat_v = flat_rows(present_k), flat_rows(present_v)
    c = _constants(dev, bsz, s, hkv * cap)

    # per-entry lengths, on the device: T_b, Q_b (valid rows), P_b (cached before); a step of one new token
    # per entry (decode) has Q_b = 1 and P_b = seqlens_k: fewer launches on the step that runs most often
    seqlens = x["seqlens_k"] if x["seqlens_k"].dtype == torch.int32 else x["seqlens_k"].to(torch.int32)
    valid = None
    slots, table = None, c.table  # decode: the write goes through the table of B blocks of C positions below
    if s == 1 and "query_seqlens" not in x:
        q_len, past = c.ones, seqlens
        # present as [B, C, Hkv, Dc] (block b = entry b, block size C): entry b's new row lands at position
        # P_b through the table [[0], [1], ...]; a position >= C falls past the table's one column: not written
        flat_k, flat_v = present_k.transpose(1, 2), present_v.transpose(1, 2)
    else:
        t_len = seqlens + 1
        q_len = (x["query_seqlens"].to(torch.int32) if "query_seqlens" in x else torch.clamp(t_len, max=s))
        past = t_len - q_len
        valid = c.rows[None, :] < q_len[:, None]  # [B, S]
        pos = past[:, None] + c.rows[None, :]  # [B, S] absolute positions
        slots = torch.where(valid & (pos < cap), c.entry + pos, -1).reshape(-1)
    q, ks, vs = write(x, a, h=h, hkv=hkv, d=d, kf=kf, vf=vf, csl=c.csl, past=past, table=table, flat_k=flat_k,
                      flat_v=flat_v, slots=slots, rows=c.rows, total=total)

    qk_output = int(a["qk_output"])
    if want is not None and "output_qk" in want and not qk_output:
        raise ValueError("output 'output_qk' requested but attribute 'qk_output' is 0 (expected 1 or 2)")
    if _first_prompt_route(x, a, s, total, kf, vf, present_k, t_dtype, qk_output):
        out = _first_prompt(q, present_k, present_v, valid, t_len, bsz, s, h, hkv, d,
                            default_scale(float(a["scale"]), d))
        if out is not None:  # None: no fused backend takes it, the Triton attention below does
            return _results(out, present_k, present_v, None, want)
    _route("triton")
    out, qk = ops.paged_decode(
        q, present_k, present_v, q_len, past, c.table, ks, vs, None, None, None, sink(x, a, h, t_dtype, dev),
        x.get("attention_bias"),
        k_fmt=kf.fmt, k_scale_mode=kf.scale, v_fmt=vf.fmt, v_scale_mode=vf.scale, num_heads=h, kv_num_heads=hkv,
        head_size=d, v_head_size=d, scale=default_scale(float(a["scale"]), d), softcap=float(a["softcap"]),
        local_window_size=max(int(a["local_window_size"]), 0), is_causal=bool(int(a["causal"])),
        qk_output=qk_output, v_rotation=False, max_query_len=s, max_kv_len=total, bnsh=True, row_pad=s,
        bias_after_softcap=True)
    out = out.view(bsz, s, h * d)
    if valid is not None and s > 1:  # padding rows [Q_b, S): zero, like the reference
        out = torch.where(valid[:, :, None], out, torch.zeros((), dtype=out.dtype, device=dev))
    if qk_output:
        qk = qk.view(h, bsz, s, -1).permute(1, 0, 2, 3)[..., :total].to(t_dtype)
    return _results(out, present_k, present_v, qk if qk_output else None, want)


def _route(name: str) -> None:
    global LAST_ROUTE
    LAST_ROUTE = name


def _first_prompt_route(x, a, s, total, kf, vf, present_k, t_dtype, qk_output) -> bool:
    """Host facts only: a first prompt (S == total_sequence_length, no query_seqlens: every entry's P_b = 0,
    right-padded to S rows), causal, float caches in T and none of what torch's fused attention lacks."""
    return (s > 1 and s == total and "query_seqlens" not in x and bool(int(a["causal"]))
            and kf.fmt == common.FMT_FLOAT and vf.fmt == common.FMT_FLOAT and present_k.dtype == t_dtype
            and float(a["softcap"]) <= 0 and int(a["local_window_size"]) <= 0 and "head_sink" not in x
            and int(a["smooth_softmax"]) != 1 and "attention_bias" not in x and not qk_output
            and x["query"].shape[-1] // int(a["num_heads"]) <= MAX_HEAD_SIZE)


def _first_prompt(q, present_k, present_v, valid, t_len, bsz, s, h, hkv, d, scale) -> torch.Tensor | None:
    """A first prompt on torch's fused causal attention over the rows the prologue wrote (present[:, :, :S]).
    Entry b's valid rows i < T_b see keys 0 .. i < T_b only, so the causal mask alone is exact for them; keys
    of padding rows (never written: stale buffer contents, maybe NaN) are zeroed first so that the masked
    lanes cannot carry a NaN into the sums; padding output rows are zero, as in the reference. T_b > S (a
    seqlens_k beyond total_sequence_length) gives NaN rather than a different result."""
    from .sdpa_prefill import fused_sdpa

    keep = valid[:, None, :, None]  # [B, 1, S, 1]
    zero = torch.zeros((), dtype=present_k.dtype, device=present_k.device)
    kk = torch.where(keep, present_k[:, :, :s], zero)  # [B, Hkv, S, D]
    vv = torch.where(keep, present_v[:, :, :s], zero)
    o, route = fused_sdpa(q.view(bsz, s, h, d).transpose(1, 2), kk, vv, scale=scale, causal=True)
    if o is None:
        return None
    _route(route)
    out = o.transpose(1, 2).reshape(bsz, s, h * d)
    ok = (t_len <= s).all()
    return torch.where(valid[:, :, None] & ok, out, torch.where(ok, zero, torch.full((), float("nan"),
                                                                                    dtype=out.dtype,
                                                                                    device=out.device)))
