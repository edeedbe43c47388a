"""Split-KV paged attention on Triton: the attention part of PagedAttention after the cache write
(contract-decisions §2, §3, §7; same results as `attention_math.attend` after `paged.prologue.prepare`).

Layouts (the last dim of every tensor contiguous):
- q [N, H, D] in T (float16 / bfloat16), already normed / roped / rotated (a [N, H * D] view is accepted);
- key_cache / value_cache [NB, BS, Hkv, Dc], Dc = D (float / int8 / fp8) or D / 2 (int4 bytes); LATENT:
  value_cache None, V = the leading Dv channels of key_cache (same format and scales as K);
- k_scale / v_scale float32 [1] PER_TENSOR / [Hkv * D] PER_CHANNEL (common.static_scale_vector), scale
  caches [NB, BS, Hkv];
- sequence b owns tokens [csl[b], csl[b+1]), its KV extent is past[b] + n_b, read through block_table[b];
- output [N, H * Dv] in T; output_qk [H, N, C] float32, C = block_table.shape[1] * BS.

Split layout: the attention kernel runs on a static grid (B, Hkv * N_SUB, S * L). A program holds every query
head of its KV-head group (N_SUB sub-groups only for groups > 64 heads) as rows (query tokens x heads,
>= 16 for tl.dot) and loops over its sequence's query tokens in row chunks, lane l of L taking chunks l,
l + L, ... (L from the host bound max_query_len: a prefill's chunks run side by side, a decode step has
L = 1; a wrong bound costs speed only); for each chunk it takes the
tiles [lo, hi) the chunk can see (the window's first tile .. the chunk's last causal position, from the
run-time extent), and split s of S takes tiles [s * ceil(T / S), (s + 1) * ceil(T / S)) of those T tiles.
With S > 1 (or v_rotation, or qk_output 2) it writes partials (m in the log2 domain, l, unnormalized acc)
to an fp32 workspace [N, H, S, Dv] (+ [N, H, S, 2]); the reduce kernel (grid N x H) merges them, adds
head_sink, applies the PER_TENSOR / PER_CHANNEL V scale and the V un-rotation and writes T. With S == 1
the attention kernel normalizes and writes the output itself.

S comes from static shapes and the host-side bound max_kv_len (0 = unknown: the capacity C) to fill the
SMs, capped so the workspace stays <= 256 MB; num_splits overrides it. Bounds only size the launch: a
max_kv_len (or max_query_len) smaller than the real extent still gives the exact result, since every
program computes its key range from the sequence's real extent (clamped to C) in the kernel; it only
costs speed (fewer splits). An extent beyond C reads only the first C positions (the reference rejects it).

In-kernel dequantization: dots run in T with fp32 accumulation on the codes (exact in fp16 / bf16; fp8 is
loaded through a uint8 view); PER_TENSOR K scales the scores, PER_CHANNEL K is folded into q as hi + lo T
parts (two dots), PER_TOKEN K / V scales multiply the scores / p per key (V: normalized by the tile's largest
scale, kept in the fp16 range), PER_TENSOR / PER_CHANNEL V scale the output. int4: even channels from the low
nibbles, odd from the high ones, two dots each way. A float cache of another float type than T is rounded to T.
int8 caches run the scores on the integer tensor cores by default (INT8_MMA "k"; PAGEDKIT_INT8_MMA): q (times a
PER_CHANNEL K scale) becomes two int8 digits per row (x ~ (x1 + x2 / 254) * step) and the dot runs on the cache
codes with int32 accumulation (exact); "kv" does p @ V likewise (p, times a PER_TOKEN V scale over the tile's
largest, as two digits). The V tile's codes convert to float16 in registers by packed inline asm before going to
shared memory (QUANT_ASM; PAGEDKIT_QUANT_ASM). Quantized sides run their float dots in float16 also under
bfloat16 queries (q by an exact power-of-two row scale).
Head sizes are padded to powers of two >= 16 (masked; e.g. 80 -> 128, LATENT 576 -> 1024).

Two accessors, one kernel (design §14.3): the paged one above, and GroupQueryAttention's (gqa.py, `bnsh=True`):
contiguous caches [B, Hkv, C, Dc] read as virtual blocks of BNSH_BLOCK positions (sequence b's block j at
b * stride_z + j * BS rows, an identity block table with batch stride 0, extents clamped to C), with a
padded batch (`row_pad`: sequence b's query rows at [b * row_pad, b * row_pad + n_b)) and attention_bias added
after softcap as onnxruntime's GQA does.

Capture-safety: no host reads of device tensors (no .item() / .tolist() / bool(tensor)), static grids and
workspace sizes (torch.empty / zeros / full), so a call is CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math

import torch

from ... import settings
from ...settings import parse_tile  # noqa: F401 (decode.parse_tile: benchmarks/step_profile.py's --sweep BNxNW)
from . import common
from .common import FMT_INT4, SCALE_CHANNEL, SCALE_TENSOR, SCALE_TOKEN, SideFormat, next_pow2

__all__ = ["paged_decode"]

WORKSPACE_BYTES = 256 << 20  # cap on the split workspace N x H x S x Dv x 4
MIN_TILES_PER_SPLIT = 2  # a split reads at least this many KV tiles
# programs per SM to aim for (measured on the H200, benchmarks/results/attention_tuning.json): 16-token tiles
# (16-token blocks) want more splits in flight than 32 / 64-token ones
WAVES = 3
WAVES_SMALL_TILES = 12
MAX_SPLITS = 1024
PREFILL_BLOCK_M = 128  # rows of a prefill's tiles (query tokens x the group's heads), head sizes <= 128
MAX_LANES_WAVES = 64  # query-chunk lanes: at most this many programs per SM in all (a prefill's grid)
MAX_GRID_Z = 65535  # CUDA's limit on grid dimension z (splits x lanes)
# a quantized cache with a grid of >= this many (sequence, KV head) programs per SM takes 128-token tiles
# (H200, batch 64 / context 8192, attention_tuning.json: int8 256-token blocks 0.63 -> 0.49 ms, fp8 0.58 ->
# 0.42 ms, int4 0.59 -> 0.54 ms); smaller grids keep the per-block tiles, which fill the SMs with splits
QUANT_WIDE_PROGRAMS = 2
BNSH_BLOCK = 256  # positions per virtual block of the contiguous (BNSH) accessor
_FMT_NAMES = {"int8": common.FMT_INT8, "fp8": common.FMT_FP8, "int4": common.FMT_INT4}


def _by_code(sides: dict[str, str]) -> dict[int, str]:
    return {_FMT_NAMES[name]: s for name, s in sides.items()}


def parse_quant_asm(spec: str) -> dict[int, str]:
    """PAGEDKIT_QUANT_ASM's form (settings.parse_quant_asm) -> {format code: sides}."""
    return _by_code(settings.parse_quant_asm(spec))


# int8 caches through the integer tensor cores on the sides named ("k": the scores, q as two int8 digits against
# the cache codes with int32 accumulation; "v": p @ V likewise). Default "k" (H200, GQA 32 / 8 heads, head 128,
# batch 64 / context 4096, benchmarks/results/quant_tuning.json: 0.2123 ms with float16 dots on both sides,
# 0.1733 with the scores on integer dots, 0.2155 on both: V's codes, reduced over its rows, go through shared
# memory one byte per load). PAGEDKIT_INT8_MMA overrides it (docs/settings.md)
INT8_MMA: str = settings.read("PAGEDKIT_INT8_MMA")
# per cache format, the sides ("k" / "v") whose codes are converted to float16 by packed inline asm in the load's
# layout (_decode_kernels._ASM_*); the others take the plain conversions. Default V only on every format (same
# sweep: int8 0.2466 ms asm on both sides, 0.2123 V only, 0.2574 none; fp8 at batch 64 / context 8192, 256-token
# blocks, 0.4744 / 0.3717 / 0.4361; int4 batch 16 0.0657 / 0.0654 / 0.0720): K's codes are reduced along their
# contiguous channels and Triton's own conversion reads them as words. PAGEDKIT_QUANT_ASM overrides it
QUANT_ASM = _by_code(settings.read("PAGEDKIT_QUANT_ASM"))
# software-pipeline stages of the attention kernel on quantized caches (None: Triton's default); PAGEDKIT_QUANT_STAGES
QUANT_STAGES: int | None = settings.read("PAGEDKIT_QUANT_STAGES")
# (block_n, num_warps) of quantized caches once the grid fills the SMs (see QUANT_WIDE_PROGRAMS); PAGEDKIT_QUANT_TILE
QUANT_WIDE_TILE: tuple[int, int] = settings.read("PAGEDKIT_QUANT_TILE")
# programs per SM the splits aim for with those tiles (None: WAVES); PAGEDKIT_QUANT_WAVES
QUANT_WIDE_WAVES: float | None = settings.read("PAGEDKIT_QUANT_WAVES")
# (block_n, num_warps) and programs per SM of decode-sized queries (<= DECODE_QUERY_BOUND tokens a sequence, tiles of
# <= 16 rows: query tokens x a group's heads) on int8 / fp8 caches, head sizes <= 128, ahead of the two rules above
# (None: those rules). H200, GQA 32 / 8 heads, head 128,
# whole operator calls (benchmarks/results/quant_tile_sweep.json): 64-key tiles over 2 warps hold 4 programs per SM
# (200 registers, 55 KB of shared memory; 128 x 4 took 106 KB: 2), GQA int8 batch 64 / context 4096 0.1734 ->
# 0.1580 ms, PagedAttention fp8 batch 64 / 8192 256-token blocks 0.3708 -> 0.3160, int8 16-token blocks batch 16
# 0.0801 -> 0.0664 with 4 programs per SM. PAGEDKIT_QUANT_DECODE_TILE / _WAVES override them ("0": off)
QUANT_DECODE_TILE: tuple[int, int] | None = settings.read("PAGEDKIT_QUANT_DECODE_TILE")  # (64, 2)
QUANT_DECODE_WAVES: float = settings.read("PAGEDKIT_QUANT_DECODE_WAVES")  # 4.0
# (block_n, num_warps) of float caches at decode-sized queries (<= DECODE_QUERY_BOUND tokens a sequence) through the
# block table (None: the per-block tiles below), and the programs per SM their splits aim for (None: WAVES /
# WAVES_SMALL_TILES); PAGEDKIT_DECODE_TILE / PAGEDKIT_DECODE_WAVES set them (benchmarks/step_profile.py --sweep
# sets them in-process)
DECODE_QUERY_BOUND = 8
DECODE_TILE: tuple[int, int] | None = settings.read("PAGEDKIT_DECODE_TILE")
DECODE_WAVES: float | None = settings.read("PAGEDKIT_DECODE_WAVES")
# software-pipeline stages of decode-sized float attention (None: Triton's default); PAGEDKIT_DECODE_STAGES
DECODE_STAGES: int | None = settings.read("PAGEDKIT_DECODE_STAGES")
_POISON = False  # tests: fill outputs and workspaces with NaN instead of leaving them uninitialized


def _empty(shape, dtype, device) -> torch.Tensor:
    if _POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H200's SM count: the interpreter runs the GPU heuristics


_TABLES: dict[tuple, torch.Tensor] = {}


def bnsh_block(capacity: int) -> int:
    """Positions per virtual block of the BNSH accessor for a cache of `capacity` rows."""
    return min(BNSH_BLOCK, max(16, next_pow2(capacity)))


def bnsh_capacity(capacity: int) -> int:
    """Key positions the BNSH accessor's virtual block table spans (output_qk's last dim): >= capacity."""
    bs = bnsh_block(capacity)
    return -(-capacity // bs) * bs


def _identity_table(device: torch.device, n: int) -> torch.Tensor:
    """int32 [1, n] = 0 .. n-1 (the BNSH accessor's block table), one persistent tensor per (device, n)."""
    key = (str(device), n)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(n, dtype=torch.int32, device=device)[None]
    return _TABLES[key]


def _pick_splits(programs: int, tiles: int, rows_bytes: int, num_sms: int, waves: int = WAVES) -> int:
    """Splits to fill ~`waves` programs per SM, >= MIN_TILES_PER_SPLIT tiles each, workspace capped."""
    want = max(1, round(waves * num_sms / max(programs, 1)))
    s = max(1, min(want, tiles // MIN_TILES_PER_SPLIT))
    return max(1, min(s, WORKSPACE_BYTES // max(rows_bytes, 1), MAX_SPLITS))


def _pick_lanes(q_bound: int, q_chunk: int, programs: int, num_sms: int) -> int:
    """Query-chunk lanes per (sequence, KV head, split): every chunk of the longest query its own program, up to
    enough programs to fill the SMs many times over (a lane loops over chunks p, p + lanes, ...: any bound is
    correct, a low one only slower)."""
    chunks = -(-max(q_bound, 1) // q_chunk)
    return max(1, min(chunks, MAX_LANES_WAVES * num_sms // max(programs, 1) or 1))


def paged_decode(q, *, key_cache, value_cache, k_format: SideFormat, v_format: SideFormat | None,
                 cumulative_sequence_length, past_seqlens, block_table,
                 num_heads: int, kv_num_heads: int, head_size: int, v_head_size: int, scale: float,
                 k_scale=None, v_scale=None,
                 k_scale_cache=None, v_scale_cache=None,
                 query_positions=None, softcap: float = 0.0, local_window_size: int = 0, is_causal: bool = True,
                 head_sink=None, attention_bias=None, qk_output: int = 0, v_rotation: bool = False,
                 max_query_len: int = 0, max_kv_len: int = 0, num_splits: int | None = None,
                 bnsh: bool = False, row_pad: int = 0, bias_after_softcap: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Paged attention over the (already written) caches -> (output [N, H*Dv] in q's dtype, output_qk
    [H, N, C] float32 or None). See the module docstring for layouts, splits and bounds."""
    return _paged_decode(
        q, key_cache=key_cache, value_cache=value_cache, k_format=k_format, v_format=v_format,
        cumulative_sequence_length=cumulative_sequence_length, past_seqlens=past_seqlens,
        block_table=block_table, num_heads=num_heads, kv_num_heads=kv_num_heads, head_size=head_size,
        v_head_size=v_head_size, scale=scale, k_scale=k_scale, v_scale=v_scale, k_scale_cache=k_scale_cache,
        v_scale_cache=v_scale_cache, query_positions=query_positions, softcap=softcap,
        local_window_size=local_window_size, is_causal=is_causal, head_sink=head_sink,
        attention_bias=attention_bias, qk_output=qk_output, v_rotation=v_rotation, max_query_len=max_query_len,
        max_kv_len=max_kv_len, num_splits=num_splits, bnsh=bnsh, row_pad=row_pad,
        bias_after_softcap=bias_after_softcap)



def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"paged_decode: {msg}")


def _static(scale, fmt: SideFormat, name: str, numel: int):
    """The PER_TENSOR (float32 [1]; the kernels read element 0 — the [Hkv * D] broadcast of it is taken too) /
    PER_CHANNEL (float32 [Hkv * D]) scale the side uses, else None."""
    if fmt.scale not in (SCALE_TENSOR, SCALE_CHANNEL):
        return None
    _check(scale is not None and scale.numel() in ((1, numel) if fmt.scale == SCALE_TENSOR else (numel,))
           and scale.dtype == torch.float32,
           f"{name} should be " + ("one float32 value (PER_TENSOR)" if fmt.scale == SCALE_TENSOR else
                                   f"a float32 vector of kv_num_heads * head_size = {numel} elements"))
    return scale.reshape(-1).contiguous()


def _token(scale_cache, fmt: SideFormat, name: str, shape: tuple):
    """A PER_TOKEN scale cache [NB, BS, Hkv] the side uses, else None."""
    if fmt.scale != SCALE_TOKEN:
        return None
    _check(scale_cache is not None and tuple(scale_cache.shape) == shape, f"{name} should be {list(shape)}")
    return scale_cache


def _paged_decode(q, *, key_cache, value_cache, k_format, v_format, cumulative_sequence_length, past_seqlens,
                  block_table, num_heads, kv_num_heads, head_size, v_head_size, scale, k_scale, v_scale,
                  k_scale_cache, v_scale_cache, query_positions, softcap, local_window_size, is_causal, head_sink,
                  attention_bias, qk_output, v_rotation, max_query_len, max_kv_len, num_splits,
                  block_n: int | None = None, block_m: int | None = None, num_warps: int | None = None,
                  num_lanes: int | None = None, bnsh: bool = False, row_pad: int = 0,
                  bias_after_softcap: bool = False, num_stages: int | None = None):
    """paged_decode with tile overrides (block_n / block_m / num_warps / num_lanes: tests and tuning) and the
    GroupQueryAttention accessors (gqa.py): `bnsh` reads contiguous caches [B, Hkv, C, Dc] instead of the paged
    ones (block_table is then ignored: sequence b reads its own rows, virtual blocks of BNSH_BLOCK positions);
    `row_pad` > 0 takes a padded batch, sequence b's rows at [b * row_pad, b * row_pad + n_b) with
    cumulative_sequence_length holding n_b [B]; `bias_after_softcap` adds attention_bias after softcap."""
    common.require_triton()
    from . import _decode_kernels as K

    H, Hkv, D = int(num_heads), int(kv_num_heads), int(head_size)
    n_tok = q.shape[0]
    q = q.reshape(n_tok, H, D)
    if q.stride(-1) != 1:
        q = q.contiguous()
    dev, T = q.device, q.dtype
    _check(T in (torch.float16, torch.bfloat16), f"query should be float16 or bfloat16, got {T}")
    _check(H % Hkv == 0, f"num_heads {H} should be a multiple of kv_num_heads {Hkv}")
    latent = value_cache is None
    DV = int(v_head_size) or D
    if latent:
        value_cache, v_format, v_scale, v_scale_cache = key_cache, k_format, k_scale, k_scale_cache
        _check(DV <= D, f"v_head_size {DV} should be <= head_size {D} with LATENT")
    else:
        _check(DV == D, f"v_head_size {DV} should equal head_size {D} (LATENT only differs)")
    if bnsh:  # [B, Hkv, C, Dc] read as virtual blocks of BS positions: block j of sequence b at b * stride_z + j * BS
        bz, hkv_c, kv_cap, dc = key_cache.shape
        _check(value_cache is not None and value_cache.shape[:3] == key_cache.shape[:3],
               "value_cache should match key_cache's first 3 dims")
        _check(bz == past_seqlens.shape[0], f"key_cache dimension 0 should be batch_size {past_seqlens.shape[0]}")
        BS = bnsh_block(kv_cap)
        NB = -(-kv_cap // BS)
        block_table = _identity_table(dev, NB).expand(bz, NB)  # stride 0 over the batch
        k_st = (BS * key_cache.stride(2), key_cache.stride(2), key_cache.stride(1), key_cache.stride(0))
        v_st = (BS * value_cache.stride(2), value_cache.stride(2), value_cache.stride(1), value_cache.stride(0))
    else:
        NB, BS, hkv_c, dc = key_cache.shape
        kv_cap = None
        k_st = (*key_cache.stride()[:3], 0)
        v_st = None
    _check(hkv_c == Hkv, f"key_cache's KV-head dimension should be kv_num_heads {Hkv}, got {hkv_c}")
    k_int4, v_int4 = k_format.fmt == FMT_INT4, v_format.fmt == FMT_INT4
    _check(dc == (D // 2 if k_int4 else D), f"key_cache dimension 3 should be {D // 2 if k_int4 else D}, got {dc}")
    _check(value_cache.shape[:3] == key_cache.shape[:3], "value_cache should match key_cache's first 3 dims")
    _check(key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, "caches need a contiguous last dim")
    _check(BS >= 16 and BS & (BS - 1) == 0, f"block_size should be a power of two >= 16, got {BS}")
    _check(not (v_rotation and (latent or DV & (DV - 1))), "v_rotation needs a non-LATENT power-of-two head")
    if not bnsh:
        v_st = (*value_cache.stride()[:3], 0)
    B, MB = past_seqlens.shape[0], block_table.shape[1]
    C = MB * BS
    kv_cap = C if kv_cap is None else kv_cap
    row_pad = int(row_pad)
    qk_output, window = int(qk_output), int(local_window_size)
    scale = float(scale) or 1.0 / math.sqrt(D)

    out = _empty((n_tok, H * DV), T, dev)
    qk = None
    if qk_output:
        qk = (torch.zeros if qk_output == 1 else functools.partial(torch.full, fill_value=float("-inf")))(
            (H, n_tok, C), dtype=torch.float32, device=dev)
    if n_tok == 0 or B == 0:
        if B == 0:
            out.zero_()
        return out, qk

    # tiles
    G = H // Hkv
    g_pad = next_pow2(G)
    KW = D // 2 if k_int4 else D
    VW = DV // 2 if v_int4 else DV
    kw_pad, vw_pad = max(16, next_pow2(KW)), max(16, next_pow2(VW))
    wide = max(kw_pad, vw_pad)
    # heads per program: 64, or 16 on heads padded past 512 channels (LATENT 576 -> 1024: 64 rows of Q and its
    # tiles need 278 KB of shared memory, over the H200's 227 KB, at DeepSeek-V3's 128 heads)
    g_tile = min(g_pad, 64 if wide <= 512 else 16)
    n_sub = g_pad // g_tile
    # rows per chunk from the per-sequence query bound (unknown: the mean tokens per sequence)
    q_bound = min(int(max_query_len) or -(-n_tok // B), row_pad or n_tok, n_tok)
    quant = k_format.fmt != common.FMT_FLOAT or (v_format is not None and v_format.fmt != common.FMT_FLOAT)
    if block_m is None:  # prefill-sized queries on float caches take 128-row tiles (H200, 4 x 4096 causal, head
        # 128, one split: 64 rows 123 TFLOP/s, 128 rows 201 with 16-token blocks, 306 with 256-token blocks:
        # benchmarks/results/prefill_tuning.json); quantized caches keep 64 (their dequantization's registers)
        cap = (64 if quant else PREFILL_BLOCK_M) if wide <= 128 else 32
        block_m = min(max(16, g_tile * next_pow2(q_bound)), cap)
    block_m = max(int(block_m), g_tile, 16)
    q_chunk = block_m // g_tile
    waves = None
    byte_codes = {k_format.fmt, v_format.fmt if v_format is not None else k_format.fmt} <= {
        common.FMT_INT8, common.FMT_FP8}
    if (block_n is None and num_warps is None and byte_codes and q_bound <= DECODE_QUERY_BOUND and wide <= 128
            and block_m <= 16 and QUANT_DECODE_TILE is not None):  # 16 rows: what was measured (2 warps' registers)
        block_n, num_warps = QUANT_DECODE_TILE
        waves = QUANT_DECODE_WAVES
    if block_n is None and quant and wide <= 128 and B * Hkv * n_sub >= QUANT_WIDE_PROGRAMS * _num_sms(dev):
        # quantized caches are issue-bound per tile: wide tiles once the grid fills the SMs
        block_n, num_warps = QUANT_WIDE_TILE if num_warps is None else (QUANT_WIDE_TILE[0], num_warps)
        waves = QUANT_WIDE_WAVES
    if bnsh and block_n is None and num_warps is None and q_bound <= 8 and wide <= 128:
        # the contiguous accessor reads long runs without block-table lookups: wide tiles, one program per SM
        # (H200, GQA 32 / 8 heads, head 128, benchmarks/results/gqa_tuning.json: batch 16 / context 4096 0.0806
        # -> 0.0771 ms with 128-key tiles over 8 warps and one split, batch 64 0.2580 -> 0.2553 with 64-key
        # tiles; int8 batch 16 0.0882 -> 0.0790 with 64-key tiles over 4 warps and the default splits)
        if quant:
            block_n, num_warps = 64, 4
        else:
            block_n = 128 if B * Hkv * n_sub < 2 * _num_sms(dev) else 64
            num_warps, waves = 8, 1
    if (block_n is None and not quant and not bnsh and q_bound <= DECODE_QUERY_BOUND and wide <= 256
            and (DECODE_TILE is not None or DECODE_WAVES is not None)):
        if DECODE_TILE is not None:
            block_n, num_warps = DECODE_TILE if num_warps is None else (DECODE_TILE[0], num_warps)
        waves = DECODE_WAVES
    prefill_tiles = block_m >= PREFILL_BLOCK_M and not quant and block_n is None and num_warps is None
    if prefill_tiles:  # (same sweep) 64-key tiles over 8 warps on large blocks; 32 keys, 4 warps on small ones
        block_n, num_warps = (64, 8) if BS >= 64 else (32, 4)
    if block_n is None:  # one block per tile when blocks are small: a scalar block-table read per tile; tiles of
        # ~4096 key channels (32 keys of 128, 64 of 64: H200, Llama-3.2-1B-shaped decode, 32 / 8 heads, head 64,
        # 256-token blocks, a whole-step graph replay, benchmarks/results/step_profile.json: batch 8 / context 4096
        # 1.513 -> 1.433 ms, batch 32 / 4096 2.345 -> 2.173 ms with 64-key tiles)
        block_n = min(BS, 64 if wide <= 64 else 32 if wide <= 256 else 16)
    _check(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n should be a power of two >= 16, got {block_n}")
    if num_warps is None:
        num_warps = (2 if block_n == 16 else 4) if wide <= 256 else 8

    # splits (static: shapes and host bounds only)
    kv_bound = min(int(max_kv_len), kv_cap) if int(max_kv_len) > 0 else kv_cap
    span = kv_bound
    if window > 0 and is_causal:
        span = min(kv_bound, window + min(q_bound, q_chunk) - 1)
    tiles = -(-span // block_n) + (1 if window > 0 else 0)
    lanes = _pick_lanes(q_bound, q_chunk, B * Hkv * n_sub, _num_sms(dev)) if num_lanes is None else max(
        1, int(num_lanes))
    if num_splits is not None:
        S = max(1, min(int(num_splits), MAX_SPLITS))
    else:
        S = _pick_splits(B * Hkv * n_sub * lanes, tiles, n_tok * H * (DV + 2) * 4, _num_sms(dev),
                         waves or (WAVES_SMALL_TILES if block_n == 16 else WAVES))
    lanes = max(1, min(lanes, MAX_GRID_Z // S))
    direct = S == 1 and not v_rotation and qk_output != 2

    if direct:
        wacc = wml = out
    else:
        wacc = _empty((n_tok, H, S, DV), torch.float32, dev)
        wml = _empty((n_tok, H, S, 2), torch.float32, dev)

    dummy = q
    kc_arg = key_cache.view(torch.uint8) if key_cache.dtype == torch.float8_e4m3fn else key_cache
    vc_arg = value_cache.view(torch.uint8) if value_cache.dtype == torch.float8_e4m3fn else value_cache
    ks = _static(k_scale, k_format, "k_scale", Hkv * D)
    vs = _static(v_scale, v_format, "v_scale", Hkv * D)
    ksc = _token(k_scale_cache, k_format, "k_scale_cache", (NB, BS, Hkv))
    vsc = _token(v_scale_cache, v_format, "v_scale_cache", (NB, BS, Hkv))
    csl, past = cumulative_sequence_length.contiguous(), past_seqlens.contiguous()
    table = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    qpos = None if query_positions is None else query_positions.contiguous()
    sink = None if head_sink is None else head_sink.contiguous()
    ksc_st = ksc.stride() if ksc is not None else (0, 0, 0)
    vsc_st = vsc.stride() if vsc is not None else (0, 0, 0)
    bias = attention_bias
    if bias is not None:
        _check(bias.dim() == 4 and bias.shape[0] in (1, B) and bias.shape[1] in (1, H),
               f"attention_bias should be [B or 1, H or 1, Qc, Kc], got {tuple(bias.shape)}")
        b_st = (bias.stride(0) if bias.shape[0] > 1 else 0, bias.stride(1) if bias.shape[1] > 1 else 0,
                bias.stride(2), bias.stride(3))
        b_cap = (bias.shape[2], bias.shape[3])
    else:
        b_st, b_cap = (0, 0, 0, 0), (0, 0)
    need_nat = softcap > 0 or bias is not None or qk_output != 0

    if num_stages is None and quant:
        num_stages = QUANT_STAGES
    if num_stages is None and not quant:
        num_stages = DECODE_STAGES if q_bound <= DECODE_QUERY_BOUND and not bnsh else None
    stages = {} if num_stages is None else {"num_stages": int(num_stages)}
    pdl = common.pdl_launch(dev, B * Hkv * n_sub * S * lanes)
    K._attn_kernel[(B, Hkv * n_sub, S * lanes)](
        q, kc_arg, vc_arg, ks if ks is not None else dummy, vs if vs is not None else dummy,
        ksc if ksc is not None else dummy, vsc if vsc is not None else dummy,
        csl, past, table, qpos if qpos is not None else dummy,
        sink if sink is not None else dummy, bias if bias is not None else dummy,
        out, wacc, wml, qk if qk is not None else dummy,
        q.stride(0), q.stride(1), *k_st[:3], *v_st[:3], *ksc_st, *vsc_st,
        table.stride(0), *b_st, *b_cap, k_st[3], v_st[3], kv_cap, row_pad,
        n_tok, NB, MB, S, lanes, scale, float(softcap), window,
        H=H, G=G, G_TILE=g_tile, N_SUB=n_sub, Q_CHUNK=q_chunk, BLOCK_M=block_m, BLOCK_N=block_n, BS=BS,
        D=D, KW=KW, KW_PAD=kw_pad, DV=DV, VW=VW, VW_PAD=vw_pad,
        K_FMT=k_format.fmt, K_SCALE=k_format.scale, V_FMT=v_format.fmt, V_SCALE=v_format.scale,
        CAUSAL=bool(is_causal), HAS_WINDOW=window > 0, HAS_SOFTCAP=softcap > 0, HAS_BIAS=bias is not None,
        HAS_SINK=sink is not None, QK_MODE=qk_output, HAS_QPOS=qpos is not None,
        DIRECT=direct, NEED_NAT=need_nat, INTERP=common.INTERPRET, LANES=lanes > 1, PADDED=row_pad > 0,
        BIAS_AFTER=bool(bias_after_softcap) and bias is not None,
        I8_QK="k" in INT8_MMA and k_format.fmt == common.FMT_INT8 and kw_pad >= 32 and block_n >= 16,
        I8_PV="v" in INT8_MMA and v_format.fmt == common.FMT_INT8 and block_n >= 32 and vw_pad >= 16,
        ASM_K="k" in QUANT_ASM.get(k_format.fmt, "") and not common.INTERPRET,
        ASM_V="v" in QUANT_ASM.get(v_format.fmt, "") and not common.INTERPRET,
        Q_POW2=k_format.fmt != common.FMT_FLOAT and T == torch.bfloat16, num_warps=num_warps,
        PDL=common.pdl_mode(pdl), **stages, **pdl)
    if direct:
        return out, qk

    dv_pad = next_pow2(DV)
    pdl_r = common.pdl_launch(dev, n_tok * H)
    mlf = _empty((n_tok, H, 2), torch.float32, dev) if qk_output == 2 else wml
    K._reduce_kernel[(n_tok, H)](
        wacc, wml, sink if sink is not None else dummy, vs if vs is not None else dummy, out, mlf, S,
        1.0 / math.sqrt(DV), H=H, G=G, D=D, DV=DV, DV_PAD=dv_pad, S_BLOCK=min(next_pow2(S), 16),
        ROT_J=min(dv_pad, 32), HAS_SINK=sink is not None, V_SCALE=v_format.scale, ROTATE=bool(v_rotation),
        STORE_ML=qk_output == 2, num_warps=4, PDL=common.pdl_mode(pdl_r), **pdl_r)
    if qk_output == 2:
        blk = min(1024, next_pow2(C))
        K._probs_kernel[(H * n_tok, -(-C // blk))](qk, mlf, n_tok, C, H=H, BLOCK=blk, num_warps=4)
    return out, qk
