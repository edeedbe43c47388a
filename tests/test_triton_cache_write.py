"""The Triton cache-write prologue (pagedkit.kernels.triton.cache_write.write_kv) against the reference
prologue (pagedkit.kernels.paged.prologue.prepare), through Triton's interpreter without CUDA.

Every call runs on caches poisoned with a sentinel; the reference runs on its own copies. Checked: Q
(max|diff| <= 1e-3 x max|ref| fp16, 1e-2 bf16), written float cache rows within 1 ulp (float32: 1e-5 of
max), quantized codes within 1 step (int8 / int4 codes, fp8 by ordinal), PER_TOKEN scales within relative
1e-3, and every slot the reference does not write still holds the sentinel bit for bit. Also: every
PagedAttention case file's expected caches (compare_case), the float8 / bfloat16 / rint encoders bit-exact
against torch, the dedup state ready for the next call, no host reads in the launcher, bad inputs, and
teeth (a 2% wrong RoPE base, a skipped QK-norm, a 3% wrong scale, first-wins dedup fail the checks).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cases import Expected, compare_case, load_cases  # noqa: E402
from nodes import make_paged_case  # noqa: E402
from pagedkit.kernels.paged import prologue  # noqa: E402
from pagedkit.kernels.quant import unpack_int4  # noqa: E402
from pagedkit.kernels.triton import cache_write  # noqa: E402
from pagedkit.kernels.triton._rope_quant import bf16_bits, fp8_bits, rint  # noqa: E402
from pagedkit.kernels.triton.common import (FMT_FLOAT, FMT_INT8, INTERPRET, SCALE_CHANNEL, SCALE_NONE,  # noqa: E402
                                            SCALE_TENSOR, SideFormat, side_format, tl, triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs on CPU tensors

CACHES = ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache")
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
_SENTINEL = {torch.int8: -77, torch.uint8: 0xA5}  # float caches (and fp8 through its bits: 0x7F) hold NaN


def kernel_kwargs(x: dict, a: dict) -> dict:
    """write_kv's keyword arguments for a PagedAttention call (inputs x by ONNX name, attributes a)."""
    latent = a.get("kv_cache_layout") == "LATENT"
    packed = not latent and "key" not in x
    heads = a["num_heads"] + (2 * a["kv_num_heads"] if packed else 0)
    rope = bool(a.get("do_rotary", 0))
    fmt = {s: side_format(x[c], a.get(f"{s}_cache_dtype", ""), a.get(f"{s}_quant_type", "NONE"), c)
           for s, c in (("k", "key_cache"), ("v", "value_cache")) if c in x}
    return dict(num_heads=a["num_heads"], kv_num_heads=a["kv_num_heads"], head_size=x["query"].shape[1] // heads,
                cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
                block_table=x["block_table"], key_cache=x["key_cache"], value_cache=x.get("value_cache"),
                k_format=fmt["k"], v_format=fmt.get("v"), slot_mapping=x.get("slot_mapping"),
                query_positions=x.get("query_positions"), cos_cache=x.get("cos_cache") if rope else None,
                sin_cache=x.get("sin_cache") if rope else None, rotary_interleaved=bool(a.get("rotary_interleaved", 0)),
                rotary_offset=a.get("rotary_offset", 0), q_norm_weight=x.get("q_norm_weight"),
                k_norm_weight=x.get("k_norm_weight"), qk_norm_epsilon=a.get("qk_norm_epsilon", 1e-6),
                qk_rotation=bool(a.get("qk_rotation", 0)), v_rotation=bool(a.get("v_rotation", 0)),
                k_scale=x.get("k_scale"), v_scale=x.get("v_scale"), k_scale_cache=x.get("k_scale_cache"),
                v_scale_cache=x.get("v_scale_cache"), latent=latent)


def run_kernel(x: dict, a: dict, **override) -> tuple[torch.Tensor, dict]:
    x = {k: v.clone().to(DEVICE) for k, v in x.items()}
    override = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in override.items()}
    q = cache_write.write_kv(x["query"], x.get("key"), x.get("value"), **(kernel_kwargs(x, a) | override))
    return q.cpu(), {k: x[k].cpu() for k in CACHES if k in x}


def run_reference(x: dict, a: dict):
    x = {k: v.clone() for k, v in x.items()}
    step = prologue.prepare(x, a, None, validate=False)
    return step.q.to(x["query"].dtype), {k: x[k] for k in CACHES if k in x}, step.slots


def poison(x: dict) -> dict:
    x = dict(x)
    for k in CACHES:
        if k in x:
            c = x[k].clone()
            c.view(torch.uint8).fill_(0x7F) if c.dtype == torch.float8_e4m3fn else c.fill_(
                _SENTINEL.get(c.dtype, float("nan")))
            x[k] = c
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_RAW[t.element_size()])


def _steps(t: torch.Tensor, head_size: int) -> torch.Tensor:
    """Quantized storage as integer code ordinals (neighbouring codes differ by 1)."""
    if t.dtype == torch.uint8:
        return unpack_int4(t, head_size).long()
    if t.dtype == torch.float8_e4m3fn:
        b = t.view(torch.uint8).long()
        return torch.where(b >= 128, -(b - 128), b)
    return t.long()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def compare(x: dict, a: dict, got=None, exact: bool | None = None) -> None:
    """Kernel vs reference on poisoned caches (AssertionError on a mismatch); got: (q, caches) to check instead.
    exact (default: in the interpreter, without rotation, where float32 arithmetic is the reference's op for
    op): every Q element, cache bit and scale equal; else the tolerances of the module docstring."""
    if exact is None:
        exact = INTERPRET and not (a.get("qk_rotation") or a.get("v_rotation"))
    x = poison(x)
    ref_q, ref_c, slots = run_reference(x, a)
    q, caches = run_kernel(x, a) if got is None else got
    head_size = ref_q.shape[-1]
    assert q.shape == ref_q.shape and q.dtype == ref_q.dtype and q.is_contiguous()
    tol = 0.0 if exact else 1e-2 if q.dtype == torch.bfloat16 else 1e-3
    steps_tol = 0 if exact else 1
    assert rel(q, ref_q) <= tol, f"q: max|diff| / max|ref| = {rel(q, ref_q):.3g} > {tol}"
    written = torch.zeros(ref_c["key_cache"].shape[0] * ref_c["key_cache"].shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for name, want in ref_c.items():
        have = caches[name]
        assert have.shape == want.shape and have.dtype == want.dtype, name
        w = written.view(want.shape[:2])
        keep = _bits(have)[~w], _bits(want)[~w]
        assert torch.equal(*keep), f"{name}: a slot no token writes was changed"
        h, r = have[w], want[w]
        if "scale" in name:
            err = float(((h.double() - r.double()).abs() / r.double().abs().clamp_min(1e-30)).max()) if r.numel() else 0
            assert err <= (0 if exact else 1e-3), f"{name}: relative scale difference {err:.3g}"
        elif want.dtype in (torch.float16, torch.bfloat16):
            ulps = int((_bits(h).int() - _bits(r).int()).abs().max()) if r.numel() else 0
            assert ulps <= steps_tol, f"{name}: {ulps} ulps off the reference"
        elif want.dtype == torch.float32:
            assert rel(h, r) <= (0 if exact else 1e-5), f"{name}: {rel(h, r):.3g} off"
        else:
            steps = int((_steps(h, head_size) - _steps(r, head_size)).abs().max()) if r.numel() else 0
            assert steps <= steps_tol, f"{name}: codes differ by {steps} steps"
            if exact and want.dtype == torch.uint8:  # int4: the pad nibble of an odd head_size too (zero code 8)
                assert torch.equal(h, r), f"{name}: packed int4 bytes differ (the pad nibble of an odd head_size?)"


def case(**kw):
    kw = {"num_heads": 4, "kv_num_heads": 2, "head_size": 16} | kw
    c = make_paged_case(**kw)
    return c.inputs, c.attrs


RANDOM = {
    "fp16_half_ragged": {},
    "bf16_packed_interleaved": {"dtype": torch.bfloat16, "packed": True, "attrs": {"rotary_interleaved": 1}},
    "fp16_partial_offset_interleaved": {"head_size": 32, "rotary_dim": 8, "rotary_offset": 8,
                                        "attrs": {"rotary_interleaved": 1}},
    "bf16_partial_offset_half": {"dtype": torch.bfloat16, "head_size": 32, "rotary_dim": 12, "rotary_offset": 4},
    "query_positions": {"query_positions": True, "shift_positions": True},
    "qk_norm_fp16": {"qk_norm": True, "attrs": {"qk_norm_epsilon": 1e-5}},
    "qk_norm_bf16_packed_rotation": {"qk_norm": True, "dtype": torch.bfloat16, "packed": True, "rotation": True},
    "rotation_fp16_d32": {"head_size": 32, "rotation": True},
    "v_rotation_int8_per_tensor": {"cache": "int8", "quant": "PER_TENSOR", "attrs": {"v_rotation": 1}},
    "int8_per_channel_bf16": {"cache": "int8", "quant": "PER_CHANNEL", "dtype": torch.bfloat16},
    "int8_per_token_fp16_scales": {"cache": "int8", "quant": "PER_TOKEN"},
    "int8_per_token_fp32_scales_rotation": {"cache": "int8", "quant": "PER_TOKEN", "scale_cache_dtype": torch.float32,
                                            "rotation": True},
    "fp8_per_tensor": {"cache": "fp8", "quant": "PER_TENSOR"},
    "fp8_per_channel_bf16": {"cache": "fp8", "quant": "PER_CHANNEL", "dtype": torch.bfloat16},
    "fp8_per_token": {"cache": "fp8", "quant": "PER_TOKEN", "qk_norm": True},
    "fp8_per_token_fp32_scales": {"cache": "fp8", "quant": "PER_TOKEN", "scale_cache_dtype": torch.float32},
    "int4_per_tensor": {"cache": "int4", "quant": "PER_TENSOR"},
    "int4_per_channel_bf16": {"cache": "int4", "quant": "PER_CHANNEL", "dtype": torch.bfloat16},
    "int4_per_token_rotation": {"cache": "int4", "quant": "PER_TOKEN", "rotation": True},
    "int4_per_token_odd_head": {"cache": "int4", "quant": "PER_TOKEN", "head_size": 13, "rotary_dim": 6,
                                "scale_cache_dtype": torch.float32},
    "latent_fp16": {"latent": True, "kv_num_heads": 1, "head_size": 40, "v_head_size": 32, "rotary_offset": 32,
                    "rotary_dim": 8},
    "latent_int4_per_token_bf16": {"latent": True, "kv_num_heads": 1, "head_size": 40, "v_head_size": 32,
                                   "rotary_offset": 32, "rotary_dim": 8, "cache": "int4", "quant": "PER_TOKEN",
                                   "dtype": torch.bfloat16},
    "block32_decode_mqa": {"block_size": 32, "kv_num_heads": 1, "past": (40, 0, 70, 31), "q_lens": (1, 1, 1, 1)},
    "block32_prefill_long": {"block_size": 32, "past": (0, 33), "q_lens": (37, 5), "rotary": False},
    "float32_cache": {"cache_float32": True},
    "many_heads_d128": {"num_heads": 32, "kv_num_heads": 32, "head_size": 128, "past": (3,), "q_lens": (2,)},
    "many_heads_d128_rotation": {"num_heads": 32, "kv_num_heads": 8, "head_size": 128, "past": (9,), "q_lens": (1,),
                                 "rotation": True, "cache": "int8", "quant": "PER_TOKEN"},
}


# head sizes below their power-of-two tile (BLOCK_D 16): the masked pad channels must stay out of the QK-norm's
# sum of squares, the PER_TOKEN amax (inputs < 1: a pad of 1.0 would be the max) and the int4 pad nibble
PAD_EDGES = {
    "qk_norm_odd_head_fp16": {"qk_norm": True, "head_size": 12, "rotary_dim": 8},
    "qk_norm_odd_head_int8_per_token_small": {"qk_norm": True, "head_size": 12, "rotary_dim": 8, "cache": "int8",
                                              "quant": "PER_TOKEN", "input_scale": 0.125},
    "fp8_per_token_odd_head_small": {"cache": "fp8", "quant": "PER_TOKEN", "head_size": 10, "rotary": False,
                                     "input_scale": 0.125},
    "int4_per_tensor_odd_head_no_rope": {"cache": "int4", "quant": "PER_TENSOR", "head_size": 7, "rotary": False},
}


def random_case(name: str, seed: int = 0):
    kw = dict(RANDOM[name] if name in RANDOM else PAD_EDGES[name])
    extra, shift, f32 = kw.pop("attrs", {}), kw.pop("shift_positions", False), kw.pop("cache_float32", False)
    small = kw.pop("input_scale", None)
    x, a = case(seed=seed, **kw)
    if small is not None:  # a power of two: exact in every float dtype
        for k in ("query", "key", "value"):
            if k in x:
                x[k] = x[k] * small
    a.update(extra)
    if shift:  # positions other than the derived ones (cos rows suffice: max derived + 7)
        x["query_positions"] = torch.randint(0, x["cos_cache"].shape[0], x["query_positions"].shape,
                                             generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    if f32:
        x["key_cache"], x["value_cache"] = x["key_cache"].float(), x["value_cache"].float()
    return x, a


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_matches_reference(name):
    compare(*random_case(name, seed=sorted(RANDOM).index(name)))


@pytest.mark.parametrize("name", sorted(PAD_EDGES))
def test_pad_channels_stay_out(name):
    """head_size not a power of two: the tile's pad channels (masked loads) reach no norm, scale or byte."""
    compare(*random_case(name, seed=100 + sorted(PAD_EDGES).index(name)))


def test_slot_mapping_writes_slot_zero():
    """Slot 0 (block 0, offset 0) is a slot like any other: a token mapped there is written."""
    x, a = case(slot_mapping=True, past=(0, 5, 20), q_lens=(4, 3, 2), seed=12)
    sm = x["slot_mapping"].clone()
    sm[sm == 0] = -1  # no other token there
    sm[2] = 0
    x["slot_mapping"] = sm
    compare(x, a)
    _, caches = run_kernel(poison(x), a)
    assert not caches["key_cache"][0, 0].float().isnan().any()


def test_slot_mapping_with_skips_and_duplicates_last_wins():
    x, a = case(slot_mapping=True, past=(0, 5, 20), q_lens=(4, 3, 2), seed=11)
    sm = x["slot_mapping"].clone()
    sm[1] = -1
    sm[6] = -1
    sm[3] = sm[0]  # tokens 0 and 3 share a slot: token 3's values win
    sm[8] = sm[4]  # across sequences
    sm[7] = sm[2] = sm[5]  # three writers: token 7
    x["slot_mapping"] = sm
    compare(x, a)
    q, caches = run_kernel(poison(x), a)
    want = run_kernel(poison(x), a, slot_mapping=torch.where(torch.arange(9) == 7, sm, -1).to(torch.int32))[1]
    slot = int(sm[7])
    blk, off = divmod(slot, x["key_cache"].shape[1])
    assert torch.equal(caches["key_cache"][blk, off], want["key_cache"][blk, off])
    first_wins = run_kernel(poison(x), a, slot_mapping=torch.where(torch.arange(9) == 2, sm, -1).to(torch.int32))[1]
    with pytest.raises(AssertionError):  # teeth: a first-wins dedup is told apart
        assert torch.equal(caches["key_cache"][blk, off], first_wins["key_cache"][blk, off])
    _assert_state_ready()


def _assert_state_ready():
    """After a call every dedup state has its finished counter back at 0 (the last K/V program reset it)."""
    for st in cache_write._STATES.values():
        assert int(st[-2]) == 0, "finished counter not reset"


def test_epoch_advances_once_per_call():
    x, a = case(slot_mapping=True, past=(0, 5), q_lens=(3, 2), seed=16)
    run_kernel(poison(x), a)
    (st,) = [v for k, v in cache_write._STATES.items() if k[1] == x["key_cache"].shape[0] * x["key_cache"].shape[1]]
    e0 = int(st[-1])
    run_kernel(poison(x), a)
    run_kernel(poison(x), a)
    assert int(st[-1]) == e0 + 2 and int(st[-2]) == 0


def test_writes_are_gated_by_the_claim():
    """Only the token holding the highest claim of its slot writes (the interpreter runs programs in token
    order, so last-wins alone would not show the gate): a claim planted for this call by a higher token
    index keeps tokens 0 and 3 (sharing a slot) from writing, so that slot keeps its poison, while every
    other token writes as usual; a stale claim (an older epoch) gates nothing."""
    x, a = case(slot_mapping=True, past=(0, 5, 20), q_lens=(4, 3, 2), seed=15)
    sm = x["slot_mapping"].clone()
    sm[3] = sm[0]
    sm[5] = -1
    x["slot_mapping"] = sm
    _, clean = run_kernel(poison(x), a)  # creates the state
    nslots = x["key_cache"].shape[0] * x["key_cache"].shape[1]
    st = cache_write._STATES[(str(torch.device(DEVICE)), nslots)]
    epoch = int(st[-1])
    st[int(sm[0])] = (epoch << 32) | 1000  # this call: a later token (index 1000) owns the slot
    p = poison(x)
    _, gated = run_kernel(p, a)
    blk, off = divmod(int(sm[0]), x["key_cache"].shape[1])
    for name in ("key_cache", "value_cache"):
        assert torch.equal(_bits(gated[name][blk, off]), _bits(p[name][blk, off])), f"{name}: gate ignored"
        keep = torch.ones(nslots, dtype=torch.bool)
        keep[int(sm[0])] = False
        g, c = (_bits(t[name]).flatten(0, 1)[keep] for t in (gated, clean))
        assert torch.equal(g, c), f"{name}: other slots changed"
    st[int(sm[0])] = ((epoch - 5) << 32) | 1000  # stale: an older call's claim
    _, again = run_kernel(poison(x), a)
    for name in ("key_cache", "value_cache"):
        assert torch.equal(_bits(again[name]), _bits(clean[name])), name
    _assert_state_ready()


def test_block_table_unmapped_aliased_zero_token_sequence():
    x, a = case(past=(3, 0, 17, 9), q_lens=(5, 0, 6, 4), cache="int8", quant="PER_TOKEN", seed=12)
    nb = x["key_cache"].shape[0]
    bt = x["block_table"].clone()
    bt[0, 0] = -1  # unmapped: sequence 0 writes nothing
    bt[2, 1] = nb + 5  # out of range: positions 16..21 of sequence 2 write nothing
    bt[3, 0] = bt[2, 0]  # aliased block: sequence 3 (later tokens) wins the shared offsets 9..12
    x["block_table"] = bt
    compare(x, a)


@pytest.mark.parametrize("q_lens, past", [((1, 3, 0, 0), (2, 7, 0, 5)), ((2, 0, 4), (0, 3, 9)),
                                          ((0, 0, 3, 3), (1, 2, 3, 4)), ((2, 2, 2), (5, 0, 17))])
def test_row_guess_misses_take_the_search(q_lens, past):
    """Token counts that divide by the batch (the launcher guesses N / B rows per sequence) with ragged or empty
    sequences: every missed guess falls back to the search over csl, the uniform last case hits throughout."""
    x, a = case(past=past, q_lens=q_lens, cache="int8", quant="PER_TENSOR", seed=sum(q_lens) + len(past))
    compare(x, a)


def test_norm_weights_read_within_head_size():
    """QK-norm weights that end where NaN begins (views into a longer buffer), head_size 11 in a 16-channel tile:
    a weight load past head_size puts NaN into the pad channels, hence into the int4 pad nibble (zero code 8)."""
    x, a = case(head_size=11, rotary_dim=8, qk_norm=True, cache="int4", quant="PER_TOKEN", seed=16)
    views = {}
    for k in ("q_norm_weight", "k_norm_weight"):
        buf = torch.full((16 + 11,), float("nan"), dtype=x[k].dtype)
        buf[:11] = x[k]
        views[k] = buf[:11]
    compare(x, a, got=run_kernel(poison(x), a, **views))


def test_rotation_reads_within_head_size():
    """qk_rotation at head_size 8 (a 16-channel tile) with key / value ending where NaN begins: a rotation chunk
    load past head_size (the last head's pad channels) would carry NaN into the product (NaN * 0 is NaN)."""
    x, a = case(head_size=8, rotation=True, seed=17)
    a["v_rotation"] = 1
    views = {}
    for k in ("query", "key", "value"):
        buf = torch.full((x[k].numel() + 16,), float("nan"), dtype=x[k].dtype)
        buf[:x[k].numel()] = x[k].reshape(-1)
        views[k] = buf[:x[k].numel()].view(x[k].shape)
    x = poison(x)
    q = cache_write.write_kv(views["query"], views["key"], views["value"], **kernel_kwargs(x, a))
    compare(x, a, got=(q, {k: x[k] for k in CACHES if k in x}))


def test_rope_positions_past_the_cos_cache_clamp_to_its_last_row():
    """A RoPE position beyond the cos / sin caches reads their last row (P - 1), never the memory after them: the caches
    are the first P rows of taller tensors whose extra rows hold other values."""
    x, a = case(query_positions=True, rotary="half", seed=17)
    p = x["cos_cache"].shape[0]
    for k, fill in (("cos_cache", 0.25), ("sin_cache", 0.75)):
        tall = torch.full((p + 2, x[k].shape[1]), fill, dtype=x[k].dtype)
        tall[:p] = x[k]
        x[k] = tall[:p]
    qp = x["query_positions"].clone()
    qp[1] = p + 3
    x["query_positions"] = qp
    got = run_kernel(poison(x), a)
    want = run_kernel(poison(x), a, query_positions=qp.clamp(max=p - 1))
    assert torch.equal(got[0], want[0])
    for k in got[1]:
        assert torch.equal(got[1][k].view(torch.uint8), want[1][k].view(torch.uint8)), k


@pytest.mark.parametrize("form", ["every_other_column", "transposed"])
def test_strided_cos_sin_caches(form):
    """cos / sin caches whose columns are not adjacent (a [:, ::2] slice, a transposed view): the launcher passes
    only the row stride, so it must copy such views; the result equals the reference's on the contiguous caches."""
    x, a = case(head_size=16, rotary_dim=12, rotary_offset=2, seed=15)
    got = {}
    for k in ("cos_cache", "sin_cache"):
        c = x[k]
        if form == "every_other_column":
            wide = torch.full((c.shape[0], 2 * c.shape[1]), 7.0, dtype=c.dtype)
            wide[:, ::2] = c
            got[k] = wide[:, ::2]
        else:
            got[k] = c.t().contiguous().t()
        assert got[k].stride(1) != 1 and torch.equal(got[k], c)
    compare(x, a, got=run_kernel(poison(x), a, **got))


def test_token_count_zero_and_decode_of_one():
    x, a = case(past=(4, 0, 2), q_lens=(0, 0, 0), seed=13)
    q, caches = run_kernel(poison(x), a)
    assert q.shape == (0, 4, 16)
    compare(x, a)
    compare(*case(past=(15,), q_lens=(1,), cache="fp8", quant="PER_TOKEN", seed=14))


def test_case_files_caches():
    """Every PagedAttention case: write_kv's caches equal the case's expected cache outputs."""
    for c in load_cases(op="PagedAttention"):
        q, caches = run_kernel(c.inputs, c.attrs)
        want = {f"{k}_out": v for k, v in caches.items()}
        sub = c._replace(expected=Expected({k: c.expected[k] for k in want},
                                           {k: m for k, m in c.expected.defined.items() if k in want}))
        compare_case(sub, want, code_steps=0 if INTERPRET else None)


@triton.jit
def _encoders(x_ptr, f8_ptr, b16_ptr, r_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(f8_ptr + i, fp8_bits(tl.minimum(tl.maximum(x, -448.0), 448.0)), mask=m)
    tl.store(b16_ptr + i, bf16_bits(x), mask=m)
    tl.store(r_ptr + i, rint(tl.minimum(tl.maximum(x, -128.0), 127.0)), mask=m)


def test_encoders_bit_exact():
    """fp8_bits / bf16_bits / rint against torch on every fp8 value, the midpoints between neighbours (ties),
    subnormals, +-0, tiny negatives and random floats."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2
    g = torch.Generator().manual_seed(5)
    x = torch.cat([codes, mids, mids.nextafter(codes[1:]), mids.nextafter(codes[:-1]), torch.tensor([0.0, -0.0,
                   -1e-9, 1e-9, 1000.0, -1000.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.5]),
                   torch.randn(2000, generator=g) * 50, torch.randn(500, generator=g) * 1e-3]).float()
    f8, b16, r = torch.empty(len(x), dtype=torch.uint8), torch.empty(len(x), dtype=torch.int16), torch.empty_like(x)
    args = [t.to(DEVICE) for t in (x, f8, b16, r)]
    _encoders[(triton.cdiv(len(x), 1024),)](*args, len(x), BLOCK=1024)
    f8, b16, r = (t.cpu() for t in args[1:])
    assert torch.equal(f8, x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(b16, x.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(r, torch.round(x.clamp(-128, 127)))


def test_launcher_reads_nothing_on_the_host(monkeypatch):
    """The launcher (kernels stubbed) never reads a device value and sizes its grids from static shapes."""
    grids = []

    class Stub:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    def forbidden(*_a, **_k):
        raise AssertionError("host read of a tensor value")

    x, a = case(cache="int4", quant="PER_TOKEN", slot_mapping=True, query_positions=True, qk_norm=True, seed=3)
    kwargs = kernel_kwargs(x, a)
    monkeypatch.setattr(cache_write, "_write_kernel", Stub())
    for attr in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, forbidden)
    cache_write.write_kv(x["query"], x["key"], x["value"], **kwargs)
    assert grids == [(6, 2)]  # one launch


def test_teeth():
    """Perturbations the checks must catch: a 2% wrong RoPE base, a skipped QK-norm, a 3% wrong k_scale."""
    x, a = case(past=(0, 40, 90), q_lens=(3, 2, 2), qk_norm=True, seed=21)
    pos = torch.arange(x["cos_cache"].shape[0], dtype=torch.float64)[:, None]
    half = x["cos_cache"].shape[1]
    tables = {}
    for base in (10000.0, 10200.0):
        ang = pos * base ** (-torch.arange(half, dtype=torch.float64) / half)
        tables[base] = ang.cos().half(), ang.sin().half()
    x["cos_cache"], x["sin_cache"] = tables[10000.0]
    compare(x, a)
    p = poison(x)
    with pytest.raises(AssertionError, match="q:"):
        compare(x, a, got=run_kernel(p, a, cos_cache=tables[10200.0][0], sin_cache=tables[10200.0][1]))
    with pytest.raises(AssertionError, match="q:"):
        compare(x, a, got=run_kernel(p, a, q_norm_weight=None, k_norm_weight=None))
    x, a = case(cache="int8", quant="PER_TENSOR", seed=22)
    x["k_scale"] = torch.tensor([0.02])  # codes up to ~127
    compare(x, a)
    with pytest.raises(AssertionError, match="key_cache"):
        compare(x, a, got=run_kernel(poison(x), a, k_scale=torch.tensor([0.0206])))


def _bad(**changes):
    x, a = case(cache="int8", quant="PER_TENSOR", seed=4)
    kw = kernel_kwargs(x, a) | changes
    return lambda: cache_write.write_kv(x["query"], kw.pop("key", x["key"]), kw.pop("value", x["value"]), **kw)


@pytest.mark.parametrize("changes, match", [
    ({"num_heads": 0}, r"^write_kv: attributes: num_heads \(0\) should be a positive multiple of kv_num_heads \(2\)"),
    ({"kv_num_heads": 0}, r"^write_kv: attributes: num_heads \(4\) should be a positive multiple of kv_num_heads \(0\)"),
    ({"num_heads": 3}, r"^write_kv: attributes: num_heads \(3\) should be a positive multiple"),
    ({"key_cache": torch.zeros(9, 16, 2, 16, dtype=torch.float16)}, r"'key_cache'.*dtype should be torch.int8"),
    ({"key_cache": torch.zeros(9, 16, 2, 8, dtype=torch.int8)}, r"'key_cache'.*dimension 3 should be 16"),
    ({"value_cache": torch.zeros(7, 32, 2, 16, dtype=torch.int8)}, r"'value_cache'.*dimension 1 should be 16"),
    ({"key": torch.zeros(6, 48, dtype=torch.float16)}, r"'key'.*dimension 1 should be 32"),
    ({"value": torch.zeros(6, 32, dtype=torch.bfloat16)}, r"'value'.*dtype should be torch.float16"),
    ({"k_format": SideFormat(FMT_INT8, SCALE_NONE)}, r"'key_cache'.*quantized cache"),
    ({"k_format": SideFormat(FMT_INT8, SCALE_CHANNEL), "qk_rotation": True}, r"'key_cache'.*PER_CHANNEL"),
    ({"v_format": SideFormat(FMT_INT8, 3), "v_scale": None}, r"'v_scale_cache'.*required"),
    ({"v_format": SideFormat(FMT_INT8, 3)}, r"'v_scale'.*absent"),
    ({"k_scale": torch.ones(3)}, r"'k_scale'.*32"),
    ({"cos_cache": torch.zeros(40, 9, dtype=torch.float16), "sin_cache": torch.zeros(40, 9, dtype=torch.float16)},
     r"'cos_cache'.*rotary_offset"),
    ({"sin_cache": torch.zeros(40, 4, dtype=torch.float16)}, r"'sin_cache'.*dimension"),
    ({"block_table": torch.zeros(2, 3, dtype=torch.int32)}, r"'block_table'.*dimension 0 should be 3"),
    ({"slot_mapping": torch.zeros(5, dtype=torch.int32)}, r"'slot_mapping'.*dimension 0 should be 6"),
    ({"latent": True}, r"'value'.*LATENT"),
    ({"k_scale_cache": torch.zeros(9, 16, 2, dtype=torch.bfloat16), "k_format": SideFormat(FMT_INT8, 3),
      "k_scale": None}, r"'k_scale_cache'.*float16 or torch.float32"),
])
def test_bad_inputs(changes, match):
    with pytest.raises(ValueError, match=match):
        _bad(**changes)()


def test_rotation_needs_power_of_two_head_size():
    x, a = case(head_size=24, rotary=False, seed=4)
    with pytest.raises(ValueError, match=r"'head_size'.*power of two"):
        cache_write.write_kv(x["query"], x["key"], x["value"], **(kernel_kwargs(x, a) | {"qk_rotation": True}))


def test_float_format_with_scale_rejected():
    with pytest.raises(ValueError, match="key_cache"):
        _bad(key_cache=torch.zeros(9, 16, 2, 16, dtype=torch.float16), k_format=SideFormat(FMT_FLOAT, SCALE_TENSOR))()
