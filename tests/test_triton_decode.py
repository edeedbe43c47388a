"""Split-KV paged attention (pagedkit/kernels/triton/decode.py) vs the reference, in Triton's interpreter on CPU
(on CUDA the same tests run compiled).

Each case: random Q/K/V and shuffled, garbage-filled caches (tests/paged_oracle.build), the reference prologue
(`prepare`, on a copy) writes the step's tokens, the kernel runs on prepare's Step; the reference output (and
output_qk) comes from `reference.paged_attention` on another copy of the same inputs. Bound: max|diff| <= tol *
max|ref| (fp16 5e-3, bf16 2e-2, the case files' tolerances). Outputs and workspaces are poisoned with NaN.
"""

from __future__ import annotations

import pytest
import torch

from cases import Case, Expected, compare_case, load_cases
from paged_oracle import Spec, build, clone_inputs
from pagedkit import settings
from pagedkit.kernels.attention_math import default_scale
from pagedkit.kernels.paged.prologue import prepare
from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.kernels.triton import common

pytest.importorskip("triton")  # under CI a failure (conftest.py)
from pagedkit.kernels.triton import decode  # noqa: E402

TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)
Q_LENS, PAST = [3, 0, 5, 1], [10, 4, 0, 20]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(decode, "_POISON", True)


def kernel_args(st, **over) -> dict:
    """paged_decode's keyword arguments from a prologue Step (over: replacements)."""
    x, a = st.x, st.attrs
    kf = common.side_format(st.kside.cache, str(a["k_cache_dtype"]), str(a["k_quant_type"]), "key_cache")
    vf = None if st.latent else common.side_format(st.vside.cache, str(a["v_cache_dtype"]),
                                                   str(a["v_quant_type"]), "value_cache")
    kw = dict(key_cache=st.kside.cache, value_cache=None if st.latent else st.vside.cache, k_format=kf,
              v_format=vf, cumulative_sequence_length=x["cumulative_sequence_length"],
              past_seqlens=x["past_seqlens"], block_table=x["block_table"], num_heads=st.num_heads,
              kv_num_heads=st.kv_heads, head_size=st.head_size, v_head_size=st.v_head,
              scale=default_scale(float(a["scale"]), st.head_size),
              k_scale=common.static_scale_vector(x.get("k_scale"), st.kv_heads, st.head_size),
              v_scale=common.static_scale_vector(x.get("v_scale"), st.kv_heads, st.head_size),
              k_scale_cache=x.get("k_scale_cache"), v_scale_cache=x.get("v_scale_cache"),
              query_positions=x.get("query_positions"), softcap=float(a["softcap"]),
              local_window_size=int(a["local_window_size"]), is_causal=bool(int(a["is_causal"])),
              head_sink=x.get("head_sink"), attention_bias=x.get("attention_bias"), qk_output=int(a["qk_output"]),
              v_rotation=bool(int(a["v_rotation"])) and not st.latent)
    kw.update(over)
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def run_kernel(st, tiles: dict | None = None, **over):
    """The kernel on a Step (on DEVICE); results back on the CPU."""
    kw = kernel_args(st, **over)
    q = st.q.to(st.t_dtype).to(DEVICE)
    if tiles:
        out, qk = decode._paged_decode(q, max_query_len=kw.pop("max_query_len", 0), max_kv_len=kw.pop("max_kv_len", 0),
                                       num_splits=kw.pop("num_splits", None), **kw, **tiles)
    else:
        out, qk = decode.paged_decode(q, **kw)
    return out.cpu(), None if qk is None else qk.cpu()


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def errors(spec: Spec, mutate=None, tiles: dict | None = None, **over) -> tuple[float, float | None]:
    """(output error, output_qk error or None) of the kernel vs the reference, relative to max|ref|."""
    case = build(spec)
    if mutate is not None:
        mutate(case.inputs)
    ref = paged_attention(clone_inputs(case.inputs), **case.attrs)
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    out, qk = run_kernel(st, tiles, **over)
    assert out.dtype == spec.dtype and out.shape == ref["output"].shape
    err = rel(out, ref["output"])
    if "output_qk" not in ref or over.get("qk_output") == 0:
        assert qk is None
        return err, None
    assert qk.dtype == torch.float32 and qk.shape == ref["output_qk"].shape
    assert torch.equal(qk == 0, ref["output_qk"] == 0), "masked / beyond-extent entries should be exactly 0"
    return err, rel(qk, ref["output_qk"])


def check(spec: Spec, mutate=None, tiles: dict | None = None, **over) -> None:
    tol = TOL[spec.dtype]
    err, qk_err = errors(spec, mutate, tiles, **over)
    assert err <= tol, f"output max|diff| / max|ref| = {err:.3g} > {tol}"
    if qk_err is not None:
        assert qk_err <= tol, f"output_qk max|diff| / max|ref| = {qk_err:.3g} > {tol}"


def base(**kw) -> Spec:
    kw.setdefault("q_lens", list(Q_LENS))
    kw.setdefault("past", list(PAST))
    return Spec(**kw)


# --- shapes, tiles, splits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_ragged(dtype):
    """1 token per sequence, contexts 0 .. 300, auto splits (several: 8 programs for 132 SMs)."""
    assert decode._pick_splits(4 * 2, 6, 1000, 132) == 3
    check(base(q_lens=[1, 1, 1, 1], past=[0, 7, 300, 33], dtype=dtype))


@pytest.mark.parametrize("q_lens,past", [([4, 4, 0], [9, 30, 5]),  # speculative drafts
                                         ([20], [37]),  # a chunk over a prefix
                                         ([12, 3], [0, 0])])  # small full prefills
def test_multi_token(q_lens, past):
    check(base(q_lens=q_lens, past=past), num_splits=3)


@pytest.mark.parametrize("bs,bn", [(16, 64), (32, 32), (64, 16), (32, 128), (16, 16)])
def test_block_sizes_and_tiles(bs, bn):
    """BLOCK_N above BS (per-token block vector), equal, and below (one block per tile)."""
    check(base(block_size=bs, past=[70, 4, 0, 130]), tiles={"block_n": bn}, num_splits=2)


@pytest.mark.parametrize("h,hkv,d", [(4, 4, 64), (8, 2, 128), (8, 1, 80), (6, 2, 16)])
def test_groups_and_head_sizes(h, hkv, d):
    """GQA groups 1 / 4 / 8 (MQA), a group of 3 (padded), head sizes 64 / 128 / 80 / 16."""
    check(base(num_heads=h, kv_num_heads=hkv, head_size=d, q_lens=[2, 1], past=[40, 3]))


def test_group_of_128_heads_in_sub_groups():
    """A KV group wider than 64 rows runs as sub-groups (grid axis 1 = Hkv x N_SUB)."""
    check(base(num_heads=128, kv_num_heads=1, q_lens=[1, 1], past=[20, 3]), num_splits=2)


@pytest.mark.parametrize("splits", [1, 2, 5, 9])
def test_forced_splits(splits):
    """1, several, and more splits than tiles: all exact (the split range comes from the extent)."""
    check(base(past=[100, 4, 0, 20]), num_splits=splits)


@pytest.mark.parametrize("lanes,splits", [(1, 1), (2, 1), (3, 2), (7, 1), (40, 3)])
def test_query_chunk_lanes(lanes, splits):
    """A prefill's query chunks on parallel programs (lane l takes chunks l, l + L, ...): 1 lane, several, more
    lanes than chunks, with splits; a chunked prefill over a prefix, a full prefill, a window, a decode token."""
    spec = base(q_lens=[37, 1, 20], past=[25, 60, 0], attrs={"local_window_size": 24})
    check(spec, tiles={"block_m": 16, "num_lanes": lanes}, num_splits=splits)
    causal = base(q_lens=[33, 5], past=[0, 40])
    check(causal, tiles={"block_m": 16, "num_lanes": lanes}, num_splits=splits)


def test_prefill_tiles_by_default():
    """A prefill-sized query bound picks 128-row tiles (32-key tiles on 16-token blocks) and several lanes."""
    check(base(q_lens=[70, 2, 64], past=[0, 30, 9]), max_query_len=70)


def test_lanes_are_picked_from_the_query_bound_and_give_identical_results():
    """Lanes from max_query_len: a decode step gets 1, a prefill one per chunk (capped to fill the SMs); the
    lanes change which program computes a chunk, never the chunk's arithmetic: outputs are bit-identical."""
    assert decode._pick_lanes(1, 4, 8, 132) == 1
    assert decode._pick_lanes(4096, 16, 32, 132) == 256
    assert decode._pick_lanes(4096, 16, 4096, 132) == 2
    spec = base(q_lens=[29, 3], past=[11, 0])
    case = build(spec)
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    one, _ = run_kernel(st, {"block_m": 16, "num_lanes": 1}, num_splits=1)
    many, _ = run_kernel(st, {"block_m": 16, "num_lanes": 4}, num_splits=1)
    assert torch.equal(one, many)


def test_bounds_smaller_than_the_extent_still_exact():
    """max_kv_len / max_query_len are launch-size hints only; too small ones keep the exact result."""
    check(base(q_lens=[6, 1], past=[90, 200]), max_kv_len=8, max_query_len=1)
    check(base(q_lens=[6, 1], past=[90, 200]), max_kv_len=4096, max_query_len=64)


def test_split_heuristic():
    """Fill ~3 programs per SM with >= 2 tiles per split; a big prefill's workspace cap forces S = 1."""
    assert decode._pick_splits(1 * 8, 64, 32 * 130 * 4, 132) == 32  # B 1 decode, 4096 tokens: 2 tiles each
    assert decode._pick_splits(1 * 8, 1024, 32 * 130 * 4, 132) == 50  # B 1, 32k tokens in 32-token tiles
    assert decode._pick_splits(16 * 8, 128, 16 * 32 * 130 * 4, 132) == 3  # B 16, 4096 tokens
    assert decode._pick_splits(16 * 8, 256, 16 * 32 * 130 * 4, 132, waves=12) == 12  # 16-token tiles
    assert decode._pick_splits(64 * 8, 64, 64 * 32 * 130 * 4, 132) == 1  # enough programs already
    assert decode._pick_splits(8, 3, 1000, 132) == 1  # too few tiles to split
    assert decode._pick_splits(8, 1000, 8192 * 32 * 130 * 4, 132) == 1  # 8192-token prefill: 136 MB per split


def test_wide_rows_block_m():
    check(base(num_heads=8, kv_num_heads=1, q_lens=[9, 2], past=[20, 50]), tiles={"block_m": 64}, num_splits=2)


# --- masks and score features ------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 4, 17, 500])
def test_local_window(window):
    """window 1 (only the token itself), small, unaligned, and >= the context."""
    check(base(past=[60, 4, 0, 100], attrs={"local_window_size": window}), tiles={"block_n": 16}, num_splits=2)


@pytest.mark.parametrize("window", [-1, 3])
def test_non_causal(window):
    check(base(attrs={"is_causal": 0, "local_window_size": window}), num_splits=2)


def test_softcap_and_sink():
    check(base(sink=True, attrs={"softcap": 2.0, "scale": 0.6}))  # direct (S = 1) path
    check(base(sink=True, attrs={"softcap": 2.0, "scale": 0.6}), num_splits=3)  # reduce path


@pytest.mark.parametrize("per_b,per_h", [(True, True), (False, False), (True, False)])
def test_attention_bias(per_b, per_h):
    check(base(bias=(per_b, per_h)), num_splits=2)


@pytest.mark.parametrize("mode,splits", [(1, 1), (1, 3), (2, 1), (2, 3)])
def test_output_qk(mode, splits):
    check(base(sink=mode == 2, bias=(True, True), attrs={"qk_output": mode, "softcap": 3.0}), num_splits=splits)


def test_unmapped_and_out_of_range_blocks():
    """-1 and >= num_blocks table entries over past-only blocks are masked (read nowhere)."""
    def mutate(x):
        nb = x["key_cache"].shape[0]
        x["block_table"][0, 1] = nb + 3
        x["block_table"][3, 0] = 1 << 30

    check(base(past=[40, 4, 0, 40], unmapped=((0, 0),)), mutate=mutate, num_splits=2)


def test_query_positions_shifted():
    check(base(query_positions=[5, 6, 7, 0, 1, 2, 3, 4, 30], attrs={"local_window_size": 5}), num_splits=2)


def test_zero_token_sequence_and_empty_step():
    check(base(q_lens=[0, 2, 0], past=[5, 3, 0]))
    st = prepare(clone_inputs(build(base(q_lens=[0, 0], past=[3, 0])).inputs),
                 {"num_heads": 4, "kv_num_heads": 2, "qk_output": 1}, None)
    out, qk = run_kernel(st)
    assert out.shape == (0, 4 * 16) and qk.shape == (4, 0, st.capacity)


def test_query_rows_without_sequences_give_zeros():
    """No sequence (B = 0) but query rows (paged_decode is public): the rows are zeros, not the poisoned buffer."""
    st = prepare(clone_inputs(build(base(q_lens=[2, 1], past=[3, 0])).inputs), {"num_heads": 4, "kv_num_heads": 2},
                 None)
    out, _ = run_kernel(st, cumulative_sequence_length=torch.zeros(1, dtype=torch.int32),
                        past_seqlens=torch.zeros(0, dtype=torch.int32),
                        block_table=torch.zeros((0, st.x["block_table"].shape[1]), dtype=torch.int32))
    assert out.shape == (3, 4 * 16) and bool((out == 0).all())


def test_extent_beyond_the_block_table_is_memory_safe():
    """An extent past the table's capacity (the reference rejects it) reads only the first C positions."""
    case = build(base(q_lens=[1, 1], past=[20, 5], extra_cols=0))
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    past = st.x["past_seqlens"].clone()
    past[0] = 10_000
    out, _ = run_kernel(st, past_seqlens=past, num_splits=3)
    assert torch.isfinite(out.float()).all()


# --- quantized caches, rotation, LATENT ----------------------------------------------------------------------


@pytest.mark.parametrize("cache", ["int8", "float8e4m3fn", "int4"])
@pytest.mark.parametrize("quant", ["PER_TENSOR", "PER_CHANNEL", "PER_TOKEN"])
def test_quantized_caches(cache, quant):
    for splits in (1, 2):  # the V output scale in the attention kernel and in the reduce
        check(base(cache=cache, k_quant=quant, v_quant=quant, past=[40, 4, 0, 20]), num_splits=splits)


@pytest.mark.parametrize("kq,vq,dtype", [("PER_CHANNEL", "PER_TOKEN", torch.bfloat16),
                                         ("PER_TOKEN", "PER_TENSOR", torch.float16)])
def test_mixed_quant_modes(kq, vq, dtype):
    check(base(cache="int8", k_quant=kq, v_quant=vq, dtype=dtype, head_size=64, scale_cache_dtype=torch.float32))


@pytest.mark.parametrize("cache,quant", [("same", "NONE"), ("int4", "PER_TOKEN"), ("int8", "PER_TENSOR")])
def test_v_rotation(cache, quant):
    check(base(cache=cache, k_quant=quant, v_quant=quant, attrs={"qk_rotation": 1, "v_rotation": 1}))


@pytest.mark.parametrize("cache,quant", [("same", "NONE"), ("int8", "PER_TOKEN"), ("float8e4m3fn", "PER_CHANNEL"),
                                         ("int4", "PER_TENSOR")])
def test_latent(cache, quant):
    """MLA: V is the leading 32 channels of a 64-channel key cache (its format and scales too)."""
    check(base(kv_num_heads=1, head_size=64, latent=True, v_head_size=32, cache=cache, k_quant=quant,
               attrs={"scale": 0.1}), num_splits=2)


# --- the case files ------------------------------------------------------------------------------------------


PAGED_CASES = load_cases(op="PagedAttention")


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c.name for c in PAGED_CASES])
def test_case_files(case):
    """Every PagedAttention case file: the reference prologue on the case inputs, then the kernel; output and
    output_qk against the case's expected values at the case tolerance."""
    st = prepare(case.inputs, case.attrs, list(case.expected))
    meta = case.inputs.get("attention_metadata")
    bounds = [int(v) for v in meta.tolist()] if meta is not None else [0, 0]
    out, qk = run_kernel(st, max_query_len=bounds[0], max_kv_len=bounds[1])
    want = {k: v for k, v in case.expected.items() if k in ("output", "output_qk")}
    got = {"output": out} | ({"output_qk": qk} if qk is not None else {})
    compare_case(Case(case.name, case.op, case.attrs, case.inputs, Expected(want, case.expected.defined)), got)


# --- teeth ------------------------------------------------------------------------------------------------------


def test_teeth():
    """The comparison catches a 2% wrong scale, a dropped head_sink and an ignored window."""
    spec = base(head_size=64, past=[30, 4, 0, 60], sink=True, attrs={"local_window_size": 8})
    tol = TOL[spec.dtype]
    case = build(spec)
    scale = default_scale(0.0, 64)
    for over in ({"scale": scale * 1.02}, {"head_sink": None}, {"local_window_size": 0}):
        ref = paged_attention(clone_inputs(case.inputs), **case.attrs)
        st = prepare(clone_inputs(case.inputs), case.attrs, None)
        out, _ = run_kernel(st, **over)
        assert rel(out, ref["output"]) > tol, f"{over} went unnoticed"
    assert errors(spec)[0] <= tol  # and the right call passes


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_graph_capture_replays_exactly(splits):
    """No host syncs: the call captures into a CUDA graph (sync debug mode 'error' while capturing) and
    replaying it after new run-time lengths gives the eager result bit for bit."""
    case = build(base(q_lens=[1, 1, 1], past=[30, 0, 70], sink=True, attrs={"local_window_size": 40}))
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    kw = kernel_args(st, num_splits=splits, max_kv_len=128, max_query_len=1)
    q = st.q.to(st.t_dtype).to(DEVICE)
    decode.paged_decode(q, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out, _ = decode.paged_decode(q, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    kw["past_seqlens"].copy_(torch.tensor([29, 0, 60], dtype=kw["past_seqlens"].dtype))
    graph.replay()
    want, _ = decode.paged_decode(q, **kw)
    assert torch.equal(out, want)


class _LaunchSpy:
    """Wraps _decode_kernels._attn_kernel: records each launch's constexprs, then launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append({"grid": grid, **{k: v for k, v in kw.items() if k.isupper() or k == "num_warps"}})
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("tile,waves", [((64, 4), 6.0), (None, 1.0), ((32, 2), None)])
def test_decode_tile_overrides(monkeypatch, tile, waves):
    """DECODE_TILE / DECODE_WAVES (the tuning knobs of float decode) change the launch, never the result:
    64-key tiles over 16-token blocks read each tile's blocks through the table."""
    from pagedkit.kernels.triton import _decode_kernels as K

    spy = _LaunchSpy(K._attn_kernel)
    monkeypatch.setattr(K, "_attn_kernel", spy)
    monkeypatch.setattr(decode, "_num_sms", lambda device: 4)  # few SMs: the splits follow the waves, uncapped
    spec = base(q_lens=[1, 1, 1], past=[150, 7, 601])
    check(spec)  # the defaults
    default = spy.launches[-1]
    monkeypatch.setattr(decode, "DECODE_TILE", tile)
    monkeypatch.setattr(decode, "DECODE_WAVES", waves)
    check(spec)
    got = spy.launches[-1]
    if tile is not None:
        assert (got["BLOCK_N"], got["num_warps"]) == tile
    else:
        assert got["BLOCK_N"] == default["BLOCK_N"]
    if waves is not None:  # the same tile at the default waves (3 programs per SM; 12 with 16-key tiles)
        monkeypatch.setattr(decode, "DECODE_WAVES", None)
        check(spec)
        ref = spy.launches[-1]
        assert ref["BLOCK_N"] == got["BLOCK_N"]
        default_waves = decode.WAVES_SMALL_TILES if got["BLOCK_N"] == 16 else decode.WAVES
        assert (got["grid"][2] > ref["grid"][2]) if waves > default_waves else (got["grid"][2] < ref["grid"][2])
    # a prefill-sized query keeps its own tiles (the knobs are for decode)
    check(base(q_lens=[20, 1], past=[0, 40]))
    assert spy.launches[-1]["BLOCK_N"] != 64 or tile is None


@pytest.mark.parametrize("cache,picked", [("int8", True), ("float8e4m3fn", True), ("int4", False)])
def test_quantized_decode_tiles(monkeypatch, cache, picked):
    """QUANT_DECODE_TILE / QUANT_DECODE_WAVES: int8 / fp8 decode (tiles of <= 16 rows) runs 64-key tiles over 2
    warps with splits aimed at 4 programs per SM; int4, and a multi-token query whose tile has more rows, keep the
    earlier rules; "0" (None) turns it off. Every launch matches the reference."""
    from pagedkit.kernels.triton import _decode_kernels as K

    spy = _LaunchSpy(K._attn_kernel)
    monkeypatch.setattr(K, "_attn_kernel", spy)
    monkeypatch.setattr(decode, "_num_sms", lambda device: 4)  # few SMs: the splits follow the waves, uncapped
    monkeypatch.setattr(decode, "QUANT_DECODE_TILE", (64, 2))
    monkeypatch.setattr(decode, "QUANT_DECODE_WAVES", 4.0)
    spec = base(cache=cache, k_quant="PER_TENSOR", v_quant="PER_TENSOR", q_lens=[1, 1, 1], past=[150, 7, 601])
    check(spec)
    got = spy.launches[-1]
    assert got["BLOCK_M"] == 16
    assert ((got["BLOCK_N"], got["num_warps"]) == (64, 2)) == picked, got
    if picked:  # more programs per SM -> more splits
        monkeypatch.setattr(decode, "QUANT_DECODE_WAVES", 12.0)
        check(spec)
        assert spy.launches[-1]["grid"][2] > got["grid"][2]
        monkeypatch.setattr(decode, "QUANT_DECODE_TILE", None)  # off: the earlier rules' tile
        check(spec)
        assert (spy.launches[-1]["BLOCK_N"], spy.launches[-1]["num_warps"]) != (64, 2)
        monkeypatch.setattr(decode, "QUANT_DECODE_TILE", (64, 2))
        check(base(cache=cache, k_quant="PER_TENSOR", v_quant="PER_TENSOR", num_heads=8, kv_num_heads=2,
                   q_lens=[8, 8], past=[40, 30]))  # 8 tokens x a group of 4 heads: 32 rows
        wide = spy.launches[-1]
        assert wide["BLOCK_M"] > 16 and (wide["BLOCK_N"], wide["num_warps"]) != (64, 2), wide


def test_quantized_decode_tile_setting(monkeypatch):
    monkeypatch.setenv("PAGEDKIT_QUANT_DECODE_TILE", "64by2")
    with pytest.raises(ValueError, match="PAGEDKIT_QUANT_DECODE_TILE='64by2'"):
        settings.read("PAGEDKIT_QUANT_DECODE_TILE")
    monkeypatch.setenv("PAGEDKIT_QUANT_DECODE_TILE", "0")
    assert settings.read("PAGEDKIT_QUANT_DECODE_TILE") is None
    assert decode.parse_tile("32x1") == (32, 1)
