"""PagedAttention cache-write prologue in Triton: Q/K/V prologue, K/V (and PER_TOKEN scale) cache writes and
the rounded Q, with the semantics of the reference prologue (pagedkit.kernels.paged.prologue.prepare;
contract-decisions §2, §3, §7).

Layouts: query [N, H*D] (packed [N, (H + 2 Hkv)*D] when key and value are None), key / value
[N, Hkv*D] in T (float16 / bfloat16); caches [NB, BS, Hkv, Dc] (Dc = D, or (D + 1) // 2 uint8 bytes for
int4), PER_TOKEN scale caches [NB, BS, Hkv] float16 / float32, all updated in place; static scales as
float32 [Hkv*D] (common.static_scale_vector); the returned q is [N, H, D] in T, contiguous.

Per token t (all in float32): sequence b = the last b with csl[b] <= t (binary lifting over csl, B static),
position p = past[b] + t - csl[b], RoPE position query_positions[t] or p (clamped to the cos rows); then
[packed split] -> QK-norm -> RoPE (half / interleaved, channels [rotary_offset, rotary_offset + rotary_dim))
-> Hadamard rotation (qk_rotation on Q and K, v_rotation on V) -> Q rounded to T; K / V encoded per side
(cast, or int8 / fp8 / int4 codes with a PER_TENSOR / PER_CHANNEL vector or a PER_TOKEN scale that is
rounded to the scale cache's dtype before the codes use it) and written at the slot: slot_mapping[t], or
block_table[b, p // BS] * BS + p % BS when that column exists and the block is in [0, NB); else -1. A slot
outside [0, NB*BS) writes nothing (cache nor scale). Unlike the reference, out-of-range run-time values
are not errors (that needs a host read): they clamp (RoPE positions) or write nothing (slots).

One launch per call: `_write_kernel`, grid (N, ceil(H / QH) + 1). Every program derives its token's
sequence, position and RoPE row itself (a few scalar loads); programs 0..NQ-1 of a token write its Q heads,
the last one (the token's K/V program) its K and V heads and scales.

Dedup (tokens sharing a slot: the highest token index wins, as the reference's loop), in the same launch:
a persistent int64 state per (device, NB*BS) holds claim[NB*BS], done[NB*BS], a finished counter and an
epoch. A K/V program tags itself epoch << 32 | t and claims its slot with atomic_max. If the old claim is
higher it writes nothing (a later token owns the slot). Otherwise, if the old claim is from this call, its
owner has already started (it claimed), so waiting for it cannot deadlock: the program spins until
done[slot] reaches that tag (acquire), writes, then raises done[slot] to its own tag (release, after a
block barrier; the semaphore pattern of CUTLASS). Successful claims of a slot rise with t, each write
follows the previous one, so the highest t's bytes land last. The last K/V program to finish (finished
counter) resets the counter and advances the epoch, so the next call's tags exceed every stale one and
nothing is cleared. O(1) work per token, deterministic, no race on the cache bytes.

Capture-safe: no host reads of device tensors, no data-dependent shapes; grids come from N, H, Hkv, D; the
only allocation is q (caching allocator). The state is created (zeros, epoch 1) at the first call for its
(device, NB*BS): make that call before capturing (warm-up), and do not run two calls with the same NB*BS
concurrently on different streams (they share it).
"""

from __future__ import annotations

import math

import torch

from ._rope_quant import bf16_bits, encode_store, side_rows
from .common import (FMT_FLOAT, FMT_FP8, FMT_INT4, FMT_INT8, QMAX, SCALE_CHANNEL, SCALE_NONE, SCALE_TOKEN,
                     SideFormat, next_pow2, pdl_gate, pdl_launch, pdl_mode, static_scale_vector, tl, triton)

_TILE = 2048  # elements of one program's [heads, BLOCK_D] tile
_STATES: dict[tuple, torch.Tensor] = {}
_CACHE_DTYPES = {FMT_FLOAT: (torch.float16, torch.bfloat16, torch.float32), FMT_INT8: (torch.int8,),
                 FMT_FP8: (torch.float8_e4m3fn,), FMT_INT4: (torch.uint8,)}


@triton.jit
def _token_slot(t, csl_ptr, past_ptr, bt_ptr, bt_s0, bt_s1, slotmap_ptr, qpos_ptr, MB, NB, P,
                B: tl.constexpr, LOG_B: tl.constexpr, BS: tl.constexpr, HAS_SLOTMAP: tl.constexpr,
                HAS_QPOS: tl.constexpr, HAS_ROPE: tl.constexpr, ROWS: tl.constexpr = 0):
    """Token t's (int64 scalar) write slot (-1: none) and RoPE row. ROWS > 0: the launcher's guess that sequence
    b holds rows [b * ROWS, (b + 1) * ROWS) (decode steps, GroupQueryAttention's padded rows), checked against
    csl in one load level; a miss (or ROWS 0) takes the binary search over csl (LOG_B dependent loads, ~5 us of
    latency at B = 64 on the H200)."""
    b = t * 0
    search = t >= 0
    if ROWS > 0:
        guess = tl.minimum(t // ROWS, B - 1)
        lo = tl.load(csl_ptr + guess).to(tl.int64)
        hi = tl.load(csl_ptr + guess + 1).to(tl.int64)
        hit = (lo <= t) & (t < hi)
        b = tl.where(hit, guess, b)
        search = hit == 0
    if search:
        for i in tl.static_range(LOG_B):  # the last b in [0, B] with csl[b] <= t (csl non-decreasing)
            cand = b + (1 << (LOG_B - 1 - i))
            ok = cand <= B
            c = tl.load(csl_ptr + tl.where(ok, cand, 0)).to(tl.int64)
            b = tl.where(ok & (c <= t), cand, b)
    b = tl.minimum(b, B - 1)
    start = tl.load(csl_ptr + b).to(tl.int64)
    p = tl.load(past_ptr + b).to(tl.int64) + (t - start)
    if HAS_QPOS:
        rpos = tl.load(qpos_ptr + t).to(tl.int64)
    else:
        rpos = p
    if HAS_ROPE:
        rpos = tl.minimum(tl.maximum(rpos, 0), P - 1)
    if HAS_SLOTMAP:
        slot = tl.load(slotmap_ptr + t).to(tl.int64)
    else:
        col = p // BS
        ok = (p >= 0) & (col < MB)
        blk = tl.load(bt_ptr + b * bt_s0 + tl.where(ok, col, 0) * bt_s1).to(tl.int64)
        slot = tl.where(ok & (blk >= 0) & (blk < NB), blk * BS + p % BS, -1)
    slot = tl.where((slot >= 0) & (slot < NB * BS), slot, -1)
    return slot, rpos


@triton.jit
def _write_kernel(q_ptr, q_rs, k_ptr, k_rs, v_ptr, v_rs, out_ptr, state_ptr, N,
                  csl_ptr, past_ptr, bt_ptr, bt_s0, bt_s1, slotmap_ptr, qpos_ptr, MB, NB, P,
                  qw_ptr, kw_ptr, eps, eps_k, cos_ptr, sin_ptr, cos_rs, sin_rs,
                  kc_ptr, kc0, kc1, kc2, kc3, vc_ptr, vc0, vc1, vc2, vc3,
                  ksv_ptr, vsv_ptr, ksc_ptr, ks0, ks1, ks2, vsc_ptr, vs0, vs1, vs2,
                  H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  QH: tl.constexpr, KH: tl.constexpr, NQ: tl.constexpr, BS: tl.constexpr,
                  B: tl.constexpr, LOG_B: tl.constexpr, HAS_SLOTMAP: tl.constexpr, HAS_QPOS: tl.constexpr,
                  HAS_V: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, HALF: tl.constexpr,
                  ROT_OFF: tl.constexpr, INTERLEAVED: tl.constexpr, QK_ROT: tl.constexpr, V_ROT: tl.constexpr,
                  KB: tl.constexpr, INV_SQRT_D: tl.constexpr, OUT_BF16: tl.constexpr,
                  K_FMT: tl.constexpr, K_SCALE: tl.constexpr, K_BF16: tl.constexpr, K_QMAX: tl.constexpr,
                  V_FMT: tl.constexpr, V_SCALE: tl.constexpr, V_BF16: tl.constexpr, V_QMAX: tl.constexpr,
                  DEDUP: tl.constexpr, ROWS: tl.constexpr = 0, PDL: tl.constexpr = 0):
    if PDL:
        pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    slot, pos = _token_slot(t, csl_ptr, past_ptr, bt_ptr, bt_s0, bt_s1, slotmap_ptr, qpos_ptr, MB, NB, P,
                            B, LOG_B, BS, HAS_SLOTMAP, HAS_QPOS, HAS_ROPE, ROWS)
    cos_row = cos_ptr + pos * cos_rs
    sin_row = sin_ptr + pos * sin_rs
    cols = tl.arange(0, BLOCK_D)
    if g < NQ:  # Q heads [g * QH, (g + 1) * QH)
        qrows = g * QH + tl.arange(0, QH)
        qx = side_rows(q_ptr + t * q_rs, qrows, H, D, eps, qw_ptr, cos_row, sin_row, QH, BLOCK_D, HAS_NORM,
                       HAS_ROPE, HALF, ROT_OFF, INTERLEAVED, QK_ROT, KB, INV_SQRT_D)
        if OUT_BF16:
            qval = bf16_bits(qx)
        else:
            qval = qx.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * (H * D) + qrows[:, None] * D + cols[None, :], qval,
                 mask=(qrows[:, None] < H) & (cols[None, :] < D))
    else:  # K (and V) heads of the token, if no later token claimed its slot (module docstring)
        S = NB * BS
        ok = slot >= 0
        sc = tl.where(ok, slot, 0)
        if DEDUP:
            epoch = tl.load(state_ptr + 2 * S + 1)
            tag = (epoch << 32) | t
            old = tl.atomic_max(state_ptr + sc, tag, mask=ok, sem="acq_rel")
            write = ok & (old < tag)
            target = tl.where(write & (old >= (epoch << 32)), old, 0)  # this call's previous owner, else none
            seen = target * 0
            while seen < target:  # that owner is running (it claimed): wait until its bytes are written
                seen = tl.atomic_add(state_ptr + S + sc, 0, sem="acquire")
            tl.debug_barrier()
        else:  # the caller promises distinct slots (GroupQueryAttention: one row per position)
            write = ok
        blk = sc // BS
        off = sc % BS
        for h0 in tl.static_range(0, HKV, KH):
            rows = h0 + tl.arange(0, KH)
            k = side_rows(k_ptr + t * k_rs, rows, HKV, D, eps_k, kw_ptr, cos_row, sin_row, KH, BLOCK_D,
                          HAS_NORM, HAS_ROPE, HALF, ROT_OFF, INTERLEAVED, QK_ROT, KB, INV_SQRT_D)
            encode_store(k, rows, HKV, D, write, kc_ptr, kc0, kc1, kc2, kc3, blk, off, ksv_ptr, ksc_ptr,
                         ks0, ks1, ks2, KH, BLOCK_D, K_FMT, K_SCALE, K_BF16, K_QMAX)
            if HAS_V:
                v = side_rows(v_ptr + t * v_rs, rows, HKV, D, eps, kw_ptr, cos_row, sin_row, KH, BLOCK_D,
                              False, False, HALF, ROT_OFF, INTERLEAVED, V_ROT, KB, INV_SQRT_D)
                encode_store(v, rows, HKV, D, write, vc_ptr, vc0, vc1, vc2, vc3, blk, off, vsv_ptr,
                             vsc_ptr, vs0, vs1, vs2, KH, BLOCK_D, V_FMT, V_SCALE, V_BF16, V_QMAX)
        if DEDUP:
            tl.debug_barrier()
            tl.atomic_max(state_ptr + S + sc, tag, mask=write, sem="release")
            if tl.atomic_add(state_ptr + 2 * S, 1, sem="acq_rel") == N - 1:  # the last K/V program of the call
                tl.atomic_xchg(state_ptr + 2 * S, 0)
                tl.atomic_add(state_ptr + 2 * S + 1, 1)


def _fail(name: str, msg: str) -> None:
    raise ValueError(f"write_kv: {name}: {msg}")


def _check(t, name, dtypes, shape, device) -> None:
    """A present tensor's dtype (one of dtypes), shape (None entries: any) and device."""
    if not isinstance(t, torch.Tensor):
        _fail(f"input '{name}'", f"expected a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        _fail(f"input '{name}'", f"dtype should be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if shape is not None:
        if t.dim() != len(shape):
            _fail(f"input '{name}'", f"should be {len(shape)}-D {tuple(shape)}, got shape {tuple(t.shape)}")
        for i, (got, want) in enumerate(zip(t.shape, shape)):
            if want is not None and got != want:
                _fail(f"input '{name}'", f"dimension {i} should be {want}, got {got} (shape {tuple(t.shape)})")
    if t.device != device:
        _fail(f"input '{name}'", f"should be on {device}, got {t.device}")


_INTS = (torch.int32, torch.int64)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _side(name, cache, fmt, shape, scale, scale_name, scale_cache, sc_name, kv_heads, head_size, rotated, dev):
    """Validate one cache side; returns (storage view, bf16 flag, scale vector, scale cache)."""
    if not isinstance(fmt, SideFormat):
        _fail(f"format of '{name}'", f"expected a common.SideFormat, got {fmt!r}")
    _check(cache, name, _CACHE_DTYPES.get(fmt.fmt, ()), shape, dev)
    if fmt.quantized == (fmt.scale == SCALE_NONE):
        _fail(f"format of '{name}'", f"a {'quantized' if fmt.quantized else 'float'} cache with scale mode "
              f"{fmt.scale}")
    if rotated and fmt.scale == SCALE_CHANNEL:
        _fail(f"format of '{name}'", "a rotated side needs NONE, PER_TENSOR or PER_TOKEN, got PER_CHANNEL")
    vec = sc = None
    if fmt.scale == SCALE_TOKEN:
        if scale is not None:
            _fail(f"input '{scale_name}'", "should be absent with PER_TOKEN")
        if scale_cache is None:
            _fail(f"input '{sc_name}'", "required with PER_TOKEN")
        _check(scale_cache, sc_name, (torch.float16, torch.float32), (*shape[:3],), dev)
        sc = scale_cache
    elif fmt.quantized:
        if scale is None:
            _fail(f"input '{scale_name}'", "required with PER_TENSOR / PER_CHANNEL")
        _check(scale, scale_name, None, None, dev)
        if scale.numel() not in (1, kv_heads * head_size) or (fmt.scale == SCALE_CHANNEL and scale.numel() == 1
                                                              and kv_heads * head_size != 1):
            _fail(f"input '{scale_name}'", f"should hold {kv_heads * head_size} (kv_num_heads * head_size) "
                  f"float32 values, got shape {tuple(scale.shape)}")
        vec = static_scale_vector(scale, kv_heads, head_size)
    view = cache.view(torch.uint8) if fmt.fmt == FMT_FP8 else cache
    bf16 = cache.dtype == torch.bfloat16
    return (view.view(torch.int16) if bf16 else view), bf16, vec, sc


def _state(device: torch.device, n: int) -> torch.Tensor:
    """The dedup state of (device, n slots): int64 [claim n | done n | finished | epoch] (module docstring)."""
    key = (str(device), n)
    w = _STATES.get(key)
    if w is None:
        w = _STATES[key] = torch.zeros((2 * n + 2,), dtype=torch.int64, device=device)
        w[-1:].fill_(1)  # a kernel with the value as its argument: `w[-1] = 1` copies a host scalar (a sync, which
        # fails the first dedup write inside a sync-checked step or a CUDA-graph capture)
    return w


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv(query, key, value, *, num_heads: int, kv_num_heads: int, head_size: int,
             cumulative_sequence_length, past_seqlens, block_table,
             key_cache, value_cache, k_format: SideFormat, v_format: SideFormat | None,
             slot_mapping=None, query_positions=None,
             cos_cache=None, sin_cache=None, rotary_interleaved: bool = False, rotary_offset: int = 0,
             q_norm_weight=None, k_norm_weight=None, qk_norm_epsilon: float = 1e-6, k_norm_epsilon: float | None = None,
             qk_rotation: bool = False, v_rotation: bool = False,
             k_scale=None, v_scale=None,
             k_scale_cache=None, v_scale_cache=None,
             latent: bool = False, unique_slots: bool = False) -> torch.Tensor:
    """Run the prologue of one PagedAttention call and write its K/V into the caches (in place); returns
    q [N, H, D] in query's dtype. See the module docstring. Raises ValueError naming a bad input.
    unique_slots: the caller guarantees no two tokens share a slot (GroupQueryAttention's BNSH write, gqa.py):
    no dedup state, plain stores. k_norm_epsilon: K's QK-norm epsilon when it differs from Q's (GQA)."""
    H, HKV, D = int(num_heads), int(kv_num_heads), int(head_size)
    if H < 1 or HKV < 1 or D < 1 or H % HKV:
        _fail("attributes", f"num_heads ({H}) should be a positive multiple of kv_num_heads ({HKV}), head_size "
              f"({D}) positive")
    if not isinstance(query, torch.Tensor):
        _fail("input 'query'", f"expected a torch.Tensor, got {type(query).__name__}")
    dev, T, N = query.device, query.dtype, query.shape[0]
    _check(query, "query", (torch.float16, torch.bfloat16), None, dev)
    packed = key is None and value is None and not latent
    width = (H + 2 * HKV) * D if packed else H * D
    _check(query, "query", None, (None, width), dev)
    if packed:
        q_in, k_in, v_in = query[:, :H * D], query[:, H * D:(H + HKV) * D], query[:, (H + HKV) * D:]
    else:
        if key is None:
            _fail("input 'key'", "required unless query is packed (key and value both absent)")
        _check(key, "key", (T,), (N, HKV * D), dev)
        if latent:
            if value is not None or value_cache is not None or v_format is not None:
                _fail("input 'value'", "LATENT takes no value, value_cache or v_format")
            if qk_rotation or v_rotation or q_norm_weight is not None or k_norm_weight is not None:
                _fail("attribute 'kv_cache_layout'", "LATENT supports no qk_rotation, v_rotation or QK-norm")
        else:
            if value is None:
                _fail("input 'value'", "required with key (or pass neither for packed QKV)")
            _check(value, "value", (T,), (N, HKV * D), dev)
        q_in, k_in, v_in = query, key, value
    q_in, k_in = _rows(q_in), _rows(k_in)
    v_in = None if v_in is None else _rows(v_in)

    rotate_any = bool(qk_rotation) or (bool(v_rotation) and not latent)
    if rotate_any and (D & (D - 1) or D > 256):
        _fail("attribute 'head_size'", f"the Hadamard rotation needs a power of two <= 256, got {D}")
    _check(cumulative_sequence_length, "cumulative_sequence_length", _INTS, None, dev)
    _check(past_seqlens, "past_seqlens", _INTS, None, dev)
    if past_seqlens.dim() != 1:
        _fail("input 'past_seqlens'", f"should be 1-D [batch_size], got shape {tuple(past_seqlens.shape)}")
    B = past_seqlens.shape[0]
    _check(cumulative_sequence_length, "cumulative_sequence_length", None, (B + 1,), dev)
    _check(block_table, "block_table", _INTS, (B, None), dev)
    if B == 0 and N > 0:
        _fail("input 'past_seqlens'", f"batch_size 0 with token_count {N}")

    if not isinstance(key_cache, torch.Tensor) or key_cache.dim() != 4:
        _fail("input 'key_cache'", f"should be 4-D [num_blocks, block_size, {HKV}, head_size], got "
              f"{getattr(key_cache, 'shape', key_cache)}")
    NB, BS = key_cache.shape[0], key_cache.shape[1]
    kfmt = getattr(k_format, "fmt", None)
    kshape = (NB, BS, HKV, (D + 1) // 2 if kfmt == FMT_INT4 else D)
    kc, k_bf16, ksv, ksc = _side("key_cache", key_cache, k_format, kshape, k_scale, "k_scale", k_scale_cache,
                                 "k_scale_cache", HKV, D, bool(qk_rotation), dev)
    if latent:
        vc, v_bf16, vsv, vsc, vfmt = kc, False, None, None, SideFormat(FMT_FLOAT, SCALE_NONE)
    else:
        if value_cache is None or v_format is None:
            _fail("input 'value_cache'", "required (with v_format) unless LATENT")
        vfmt = v_format
        vshape = (NB, BS, HKV, (D + 1) // 2 if getattr(v_format, "fmt", None) == FMT_INT4 else D)
        vc, v_bf16, vsv, vsc = _side("value_cache", value_cache, v_format, vshape, v_scale, "v_scale",
                                     v_scale_cache, "v_scale_cache", HKV, D, bool(v_rotation), dev)
    if NB * BS >= 2 ** 31:
        _fail("input 'key_cache'", f"num_blocks * block_size should be < 2**31, got {NB * BS}")

    has_rope = cos_cache is not None
    half, P = 0, 1
    if has_rope:
        _check(cos_cache, "cos_cache", _FLOATS, None, dev)
        if cos_cache.dim() != 2 or cos_cache.shape[0] < 1:
            _fail("input 'cos_cache'", f"should be 2-D [positions, rotary_dim / 2], got {tuple(cos_cache.shape)}")
        _check(sin_cache, "sin_cache", _FLOATS, tuple(cos_cache.shape), dev)
        P, half = cos_cache.shape
        if rotary_offset < 0 or rotary_offset + 2 * half > D:
            _fail("input 'cos_cache'", f"rotary_offset ({rotary_offset}) + rotary_dim ({2 * half}) should be "
                  f"<= head_size ({D})")
        cos_cache, sin_cache = _rows(cos_cache), _rows(sin_cache)
    elif sin_cache is not None:
        _fail("input 'sin_cache'", "given without cos_cache")
    has_norm = q_norm_weight is not None or k_norm_weight is not None
    if has_norm:
        _check(q_norm_weight, "q_norm_weight", _FLOATS, (D,), dev)
        _check(k_norm_weight, "k_norm_weight", _FLOATS, (D,), dev)
        q_norm_weight, k_norm_weight = q_norm_weight.contiguous(), k_norm_weight.contiguous()
    if slot_mapping is not None:
        _check(slot_mapping, "slot_mapping", _INTS, (N,), dev)
    if query_positions is not None:
        _check(query_positions, "query_positions", _INTS, (N,), dev)

    out = torch.empty((N, H, D), dtype=T, device=dev)
    if N == 0:
        return out
    dummy = out
    state = dummy if unique_slots else _state(dev, NB * BS)
    csl, past = cumulative_sequence_length.contiguous(), past_seqlens.contiguous()

    block_d = max(next_pow2(D), 16 if rotate_any else 2)
    qh = min(next_pow2(H), max(1, _TILE // block_d))
    kh = min(next_pow2(HKV), max(1, _TILE // block_d))
    if qk_rotation:
        qh = max(qh, 16)
    if rotate_any:
        kh = max(kh, 16)
    nq = -(-H // qh)
    ks = ksc.stride() if ksc is not None else (0, 0, 0)
    vs = vsc.stride() if vsc is not None else (0, 0, 0)
    pdl = pdl_launch(dev, N * (nq + 1))
    _write_kernel[(N, nq + 1)](
        q_in, q_in.stride(0), k_in, k_in.stride(0), v_in if v_in is not None else k_in,
        (v_in if v_in is not None else k_in).stride(0), out.view(torch.int16) if T == torch.bfloat16 else out,
        state, N,
        csl, past, block_table, block_table.stride(0), block_table.stride(1),
        dummy if slot_mapping is None else slot_mapping.contiguous(),
        dummy if query_positions is None else query_positions.contiguous(), block_table.shape[1], NB, P,
        q_norm_weight if has_norm else dummy, k_norm_weight if has_norm else dummy, float(qk_norm_epsilon),
        float(qk_norm_epsilon if k_norm_epsilon is None else k_norm_epsilon),
        cos_cache if has_rope else dummy, sin_cache if has_rope else dummy,
        cos_cache.stride(0) if has_rope else 0, sin_cache.stride(0) if has_rope else 0,
        kc, *kc.stride(), vc, *vc.stride(),
        ksv if ksv is not None else dummy, vsv if vsv is not None else dummy,
        ksc if ksc is not None else dummy, *ks, vsc if vsc is not None else dummy, *vs,
        H=H, HKV=HKV, D=D, BLOCK_D=block_d, QH=qh, KH=kh, NQ=nq, BS=BS,
        B=B, LOG_B=max(1, B.bit_length()), HAS_SLOTMAP=slot_mapping is not None,
        HAS_QPOS=query_positions is not None,
        HAS_V=not latent, HAS_NORM=has_norm, HAS_ROPE=has_rope, HALF=half, ROT_OFF=int(rotary_offset),
        INTERLEAVED=bool(rotary_interleaved), QK_ROT=bool(qk_rotation), V_ROT=bool(v_rotation) and not latent,
        KB=min(block_d, 32), INV_SQRT_D=float(1.0 / math.sqrt(D)), OUT_BF16=T == torch.bfloat16,
        K_FMT=k_format.fmt, K_SCALE=k_format.scale, K_BF16=k_bf16, K_QMAX=QMAX.get(k_format.fmt, 1.0),
        V_FMT=vfmt.fmt, V_SCALE=vfmt.scale, V_BF16=v_bf16, V_QMAX=QMAX.get(vfmt.fmt, 1.0),
        DEDUP=not unique_slots, ROWS=N // B if B and N % B == 0 else 0,  # rows per sequence if uniform: a guess
        num_warps=4, PDL=pdl_mode(pdl), **pdl)
    return out
