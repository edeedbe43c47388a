"""What gqa.py (variant triton_gqa) and gqa_window.py (its windowed caches) share: the present buffers, the
shape-only index tensors, the cache-write prologue of one call, the head sink and the results dict.

Layouts as in gqa.py: query [B, S, H*D] (packed [B, S, (H + 2*Hkv)*D]); past_* / present_* [B, Hkv, C, Dc]
(Dc = D, or D / 2 uint8 bytes for int4); the cache write sees a present through a flat [rows, 1, Hkv, Dc] view
(`flat_rows`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from . import common


def _present(past: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """The present buffer [B, Hkv, C, Dc]: the past itself when it holds C rows (in place), else a new one."""
    if past is not None and past.shape[2] >= shape[2] and past.is_contiguous():
        return past
    present = torch.zeros(shape, dtype=dtype, device=device)
    if past is not None:
        keep = min(past.shape[2], shape[2])
        present[:, :, :keep] = past[:, :, :keep]
    return present


@dataclass(frozen=True)
class _Consts:
    rows: torch.Tensor  # int32 [S] = 0 .. S-1
    entry: torch.Tensor  # int32 [B, 1] = b * Hkv * C (entry b's first row in the flat cache view)
    csl: torch.Tensor  # int32 [B + 1] = 0, S, 2S, ...
    ones: torch.Tensor  # int32 [B] = 1
    table: torch.Tensor  # int32 [B, 1] = b (the decode write's block table; the BNSH attention ignores it)


_CONSTS: dict[tuple, _Consts] = {}


def _constants(dev: torch.device, bsz: int, s: int, entry_rows: int) -> _Consts:
    """Shape-only index tensors, made once per (device, B, S, Hkv * C) and reused (read only): a step launches
    only the kernels that depend on its values, and a captured step replays none of these."""
    key = (str(dev), bsz, s, entry_rows)
    if key in _CONSTS:
        return _CONSTS[key]
    i32 = dict(dtype=torch.int32, device=dev)
    made = _Consts(torch.arange(s, **i32), torch.arange(bsz, **i32)[:, None] * entry_rows,
                   torch.arange(bsz + 1, **i32) * s, torch.ones(bsz, **i32), torch.arange(bsz, **i32)[:, None])
    if not _capturing(dev):  # made inside a capture, their values exist only in replays: not kept
        if len(_CONSTS) > 64:
            _CONSTS.clear()
        _CONSTS[key] = made
    return made


_ZEROS: dict[tuple, torch.Tensor] = {}


def _zeros(dev: torch.device, n: int, dtype: torch.dtype) -> torch.Tensor:
    key = (str(dev), n, dtype)
    if key in _ZEROS:
        return _ZEROS[key]
    z = torch.zeros(n, dtype=dtype, device=dev)
    if not _capturing(dev):
        _ZEROS[key] = z
    return z


def _capturing(dev: torch.device) -> bool:
    return dev.type == "cuda" and torch.cuda.is_current_stream_capturing()


def write(x: Mapping[str, Any], a: Mapping[str, Any], *, h: int, hkv: int, d: int, kf, vf, csl, past, table,
          flat_k, flat_v, slots, rows, total: int, positions=None):
    """One call's cache-write prologue (ops.write_kv: RoPE, QK-norm, quantization, the rows to `slots` or through
    `table`) -> (q [N, H, D] in T, k_scale, v_scale as the kernels take them). RoPE positions: position_ids (a
    first prompt, no query_seqlens and S == total, reads position_ids[0, 0] + s, as onnxruntime's CPU kernel
    does), else `positions` (int32 [B * S]), else the write's P_b + s from `past`."""
    from . import ops

    query = x["query"]
    bsz, s, width = query.shape
    n_tok = bsz * s
    rotary = bool(int(a["do_rotary"]))
    qpos = positions if rotary else None
    if rotary and "position_ids" in x:
        pid = x["position_ids"]
        if "query_seqlens" not in x and s == total:
            pid = (pid.reshape(-1)[:1] + rows.to(pid.dtype)).expand(bsz, s)
        qpos = pid.reshape(-1).to(torch.int32)
    ks = common.static_scale_vector(x.get("k_scale"), hkv, d) if kf.quantized else None
    vs = common.static_scale_vector(x.get("v_scale"), hkv, d) if vf.quantized else None
    eps_q = a["q_norm_epsilon"] if a["q_norm_epsilon"] is not None else a["qk_norm_epsilon"]
    eps_k = a["k_norm_epsilon"] if a["k_norm_epsilon"] is not None else a["qk_norm_epsilon"]
    packed = "key" not in x
    q = ops.write_kv(
        query.reshape(n_tok, width), None if packed else x["key"].reshape(n_tok, hkv * d),
        None if packed else x["value"].reshape(n_tok, hkv * d), csl, past, table, flat_k, flat_v, slots, qpos,
        x.get("cos_cache") if rotary else None, x.get("sin_cache") if rotary else None, x.get("q_norm_weight"),
        x.get("k_norm_weight"), ks, vs, None, None,
        num_heads=h, kv_num_heads=hkv, head_size=d, k_fmt=kf.fmt, k_scale_mode=kf.scale, v_fmt=vf.fmt,
        v_scale_mode=vf.scale, rotary=rotary, rotary_interleaved=bool(int(a["rotary_interleaved"])),
        rotary_offset=0, qk_norm_epsilon=float(eps_q), qk_rotation=False, v_rotation=False, latent=False,
        unique_slots=True, k_norm_epsilon=float(eps_k))
    return q, ks, vs


def sink(x: Mapping[str, Any], a: Mapping[str, Any], h: int, t_dtype: torch.dtype, dev: torch.device):
    """head_sink, else for smooth_softmax=1 a zero sink (exp(0) in every denominator), else None."""
    if x.get("head_sink") is None and int(a["smooth_softmax"]) == 1:
        return _zeros(dev, h, t_dtype)
    return x.get("head_sink")


def flat_rows(buf: torch.Tensor) -> torch.Tensor:
    """A contiguous [B, Hkv, C, Dc] buffer as the cache write's [rows, 1, Hkv, Dc] view: row b * Hkv * C + p is
    position p of entry b (head 0; head h at + h * C rows)."""
    bsz, hkv, cap, dc = buf.shape
    return buf.as_strided((((bsz - 1) * hkv + 1) * cap, 1, hkv, dc), (dc, dc, cap * dc, 1))


def presents(x: Mapping[str, Any], hkv: int, cap: int, d: int, kf, vf) -> tuple[torch.Tensor, torch.Tensor]:
    """present_key / present_value [B, Hkv, cap, Dc] (Dc = D, D / 2 bytes for int4): the past buffers themselves
    when they hold cap rows (updated in place), else new ones holding the past rows; in the past's dtype, else
    the format's storage (float caches: T)."""
    query = x["query"]
    out = []
    for past, f in ((x.get("past_key"), kf), (x.get("past_value"), vf)):
        dtype = past.dtype if past is not None else {common.FMT_INT4: torch.uint8, common.FMT_INT8: torch.int8,
                                                      common.FMT_FP8: torch.float8_e4m3fn}.get(f.fmt, query.dtype)
        dc = d // 2 if f.fmt == common.FMT_INT4 else d
        out.append(_present(past, (query.shape[0], hkv, cap, dc), dtype, query.device))
    return out[0], out[1]


def _results(out, present_k, present_v, qk, want) -> dict[str, torch.Tensor]:
    result = {"output": out, "present_key": present_k, "present_value": present_v}
    if qk is not None:
        result["output_qk"] = qk
    if want is not None:
        result = {n: t for n, t in result.items() if n in want}
    return result
