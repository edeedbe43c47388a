"""The fused MLA (LATENT) attention launch (`mla_decode`) of variant triton_mla (mla.py): the latent channels and
the rope channels of one latent cache [NB, BS, 1, DL + DR] as two dot products (`_mla_kernels._mla_kernel`),
split-KV with triton_paged's reduce kernel (`_decode_kernels._reduce_kernel`).

It sits below both mla.py (the variant: its entry runs paged.py's `run`, which calls the ops of ops.py) and
ops.py (whose `pagedkit::paged_decode` with fused_mla calls `mla_decode`), so the three form no import circle.
"""

from __future__ import annotations

import math

import torch

from . import common
from .common import FMT_FLOAT, FMT_FP8, FMT_INT8, SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN, next_pow2

MAX_GROUP_TILE = 64  # query heads per program; more heads run as sub-groups (each re-reads the cache)
# programs per SM the splits aim for: at batch 64 / context 4096 / 16 heads (64 programs before splitting) 4 splits
# beat 8 and 16 (H200, benchmarks/results/mla_tuning.json)
MLA_WAVES = 2
_FORMATS = {FMT_FLOAT, FMT_INT8, FMT_FP8}
_SCALES = {SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN}


def split_channels(head_size: int, v_head_size: int) -> str | tuple[int, int]:
    """(DL, DR) = (v_head_size, head_size - v_head_size) when both are powers of two >= 16, else the reason."""
    dl, dr = int(v_head_size), int(head_size) - int(v_head_size)
    for what, n in (("v_head_size", dl), ("head_size - v_head_size", dr)):
        if n < 16 or n & (n - 1):
            return f"{what} {n} is not a power of two >= 16 (the latent / rope split)"
    return dl, dr


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"mla_decode: {msg}")


def mla_decode(q, *, key_cache, k_format, cumulative_sequence_length, past_seqlens, block_table, num_heads: int,
               head_size: int, v_head_size: int, scale: float, k_scale=None, k_scale_cache=None,
               query_positions=None, local_window_size: int = 0, is_causal: bool = True, max_query_len: int = 0,
               max_kv_len: int = 0, num_splits: int | None = None, block_n: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """LATENT attention over the (already written) latent cache -> output [N, H * DL] in q's dtype.
    q [N, H, DL + DR] (or [N, H * (DL + DR)]) in T; key_cache [NB, BS, 1, DL + DR]; k_scale float32 [DL + DR]
    (PER_TENSOR, common.static_scale_vector); k_scale_cache [NB, BS, 1] (PER_TOKEN). Tiles / splits from static
    shapes and the host bounds (a wrong bound costs speed only); num_splits / block_n / num_warps / num_stages
    override them (tests and tuning)."""
    common.require_triton()
    from . import _decode_kernels as KD
    from . import _mla_kernels as K
    from .decode import _empty, _num_sms, _pick_splits

    H, D = int(num_heads), int(head_size)
    split = split_channels(D, v_head_size)
    _check(not isinstance(split, str), str(split))
    DL, DR = split
    n_tok = q.shape[0]
    _check(q.numel() == n_tok * H * D, f"query should be [N, {H} * {D}], got {list(q.shape)}")
    q = q.reshape(n_tok, H, D)
    if q.stride(-1) != 1:
        q = q.contiguous()
    dev, T = q.device, q.dtype
    _check(T in (torch.float16, torch.bfloat16), f"query should be float16 or bfloat16, got {T}")
    _check(k_format.fmt in _FORMATS and k_format.scale in _SCALES,
           f"cache format {k_format} (serves float / int8 / fp8 with NONE / PER_TENSOR / PER_TOKEN)")
    _check(k_format.fmt != FMT_FLOAT or key_cache.dtype == T, f"a float cache should be {T}, got {key_cache.dtype}")
    NB, BS, hkv, dc = key_cache.shape
    _check(hkv == 1 and dc == D, f"key_cache should be [NB, BS, 1, {D}], got {list(key_cache.shape)}")
    _check(key_cache.stride(-1) == 1, "key_cache needs a contiguous last dim")
    B, MB = past_seqlens.shape[0], block_table.shape[1]
    window = int(local_window_size)
    out = _empty((n_tok, H * DL), T, dev)
    if n_tok == 0 or B == 0:
        if B == 0:
            out.zero_()
        return out

    g_tile = min(next_pow2(H), MAX_GROUP_TILE)
    n_sub = -(-H // g_tile)
    q_bound = min(int(max_query_len) or -(-n_tok // B), n_tok)
    block_m = max(16, min(MAX_GROUP_TILE, g_tile * next_pow2(q_bound)))
    q_chunk = block_m // g_tile
    if block_n is None:  # H200 sweep (benchmarks/results/mla_tuning.json): 32-key tiles at 16 heads, 64 at 128
        block_n = min(BS, 32 if block_m <= 16 else 64)
    if num_warps is None:
        num_warps = 4 if block_m <= 16 else 8
    if num_stages is None:  # 3 stages on float caches, 2 on int8 / fp8 (their conversion's registers)
        num_stages = 3 if k_format.fmt == FMT_FLOAT and block_m <= 16 else 2
    kv_bound = min(int(max_kv_len), MB * BS) if int(max_kv_len) > 0 else MB * BS
    if window > 0 and is_causal:
        kv_bound = min(kv_bound, window + q_chunk)
    tiles = -(-kv_bound // block_n) + (1 if window > 0 else 0)
    if num_splits is not None:
        S = max(1, int(num_splits))
    else:
        S = _pick_splits(B * n_sub, tiles, n_tok * H * (DL + 2) * 4, _num_sms(dev), MLA_WAVES)
    direct = S == 1
    wacc = wml = out
    if not direct:
        wacc = _empty((n_tok, H, S, DL), torch.float32, dev)
        wml = _empty((n_tok, H, S, 2), torch.float32, dev)
    dummy = q
    c_arg = key_cache.view(torch.uint8) if key_cache.dtype == torch.float8_e4m3fn else key_cache
    ks = None
    if k_format.scale == SCALE_TENSOR:
        _check(k_scale is not None and k_scale.numel() in (1, D) and k_scale.dtype == torch.float32,
               f"k_scale should be one float32 value (PER_TENSOR; a vector of head_size = {D} equal ones is read "
               "at element 0)")
        ks = k_scale.reshape(-1).contiguous()
    ksc = None
    if k_format.scale == SCALE_TOKEN:
        _check(k_scale_cache is not None and tuple(k_scale_cache.shape) == (NB, BS, 1),
               f"k_scale_cache should be {[NB, BS, 1]}")
        ksc = k_scale_cache
    csl, past = cumulative_sequence_length.contiguous(), past_seqlens.contiguous()
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    qpos = None if query_positions is None else query_positions.contiguous()
    K._mla_kernel[(B, n_sub, S)](
        q, c_arg, ks if ks is not None else dummy, ksc if ksc is not None else dummy, csl, past, table,
        qpos if qpos is not None else dummy, out, wacc, wml,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1),
        *((ksc.stride(0), ksc.stride(1)) if ksc is not None else (0, 0)), table.stride(0),
        n_tok, NB, MB, S, float(scale) or 1.0 / math.sqrt(D), window,
        H=H, G_TILE=g_tile, Q_CHUNK=q_chunk, BLOCK_M=block_m, BLOCK_N=block_n, BS=BS, DL=DL, DR=DR,
        FMT=k_format.fmt, SCALE=k_format.scale, CAUSAL=bool(is_causal), HAS_WINDOW=window > 0,
        HAS_QPOS=qpos is not None, DIRECT=direct, INTERP=common.INTERPRET, num_warps=num_warps,
        num_stages=int(num_stages))
    if direct:
        return out
    KD._reduce_kernel[(n_tok, H)](
        wacc, wml, dummy, ks if ks is not None else dummy, out, wml, S, 1.0 / math.sqrt(DL),
        H=H, G=H, D=D, DV=DL, DV_PAD=DL, S_BLOCK=min(next_pow2(S), 16), ROT_J=min(DL, 32), HAS_SINK=False,
        V_SCALE=SCALE_TENSOR if ks is not None else SCALE_NONE, ROTATE=False, STORE_ML=False, num_warps=4)
    return out
