"""The decode cache write fused into the attention launch (kernels/triton/decode.FusedWrite, paged.write_decode,
the custom op pagedkit::write_decode), in Triton's interpreter on the CPU (or compiled on CUDA):

- every PagedAttention case file it serves (float caches, no slot_mapping / query_positions / QK-norm / rotation /
  output_qk, no shared slot), with attention_metadata set to the case's bounds, equals the case's expected outputs
  and caches (the reference's, checked against the float64 oracle by tests/test_reference_paged.py);
- against the unfused launches (write_kv then paged_decode) on random decode steps, every split count: the same
  output and caches, bit for bit (the same rounding of q, K and V), the new slots poisoned with NaN first;
- teeth: RoPE dropped or its pairing flipped, or the new rows left unwritten, fail those comparisons;
- what it refuses (formats, inputs, bounds, the distinct-slots promise) goes the unfused way."""

from __future__ import annotations

import math
import os

import pytest
import torch

from cases import compare_case, load_cases, load_index

triton = pytest.importorskip("triton") if not os.environ.get("CI") else __import__("triton")  # CI: never skip

from pagedkit.kernels import scope  # noqa: E402
from pagedkit.kernels.triton import common, decode, ops, paged  # noqa: E402
from pagedkit.kernels.triton.cache_write import write_kv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOAT = common.SideFormat(common.FMT_FLOAT, common.SCALE_NONE)


@pytest.fixture
def fused_on(monkeypatch):
    """The fused route on, and a record of its launches."""
    calls = []
    real = ops.write_decode
    monkeypatch.setattr(paged, "FUSED_WRITE", True)
    monkeypatch.setattr(ops, "write_decode", lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


def _bounds(inputs) -> torch.Tensor:
    csl, past = inputs["cumulative_sequence_length"].long(), inputs["past_seqlens"].long()
    n_q = csl[1:] - csl[:-1]
    return torch.tensor([int(n_q.max()) if n_q.numel() else 0, int((past + n_q).max()) if n_q.numel() else 0],
                        dtype=torch.int32)


def _shared_slot(inputs) -> bool:
    """Whether two of the step's tokens write one cache slot (a case of the last-token-wins rule)."""
    csl, past, table = (inputs[k].long() for k in ("cumulative_sequence_length", "past_seqlens", "block_table"))
    bs = inputs["key_cache"].shape[1]
    slots = []
    for b in range(past.numel()):
        for j in range(int(csl[b + 1] - csl[b])):
            p = int(past[b]) + j
            if p // bs < table.shape[1] and int(table[b, p // bs]) >= 0:
                slots.append(int(table[b, p // bs]) * bs + p % bs)
    return len(slots) != len(set(slots))


def _served(case) -> bool:
    x, a = case.inputs, case.attrs
    return (a.get("kv_cache_layout", "BNSH") != "LATENT" and not int(a.get("qk_output", 0))
            and a.get("k_cache_dtype", "auto") in ("auto", "float16", "bfloat16")
            and a.get("v_cache_dtype", "auto") in ("auto", "float16", "bfloat16")
            and x["key_cache"].dtype == x["query"].dtype and not int(a.get("qk_rotation", 0))
            and not int(a.get("v_rotation", 0))
            and not any(n in x for n in ("slot_mapping", "query_positions", "q_norm_weight", "k_norm_weight"))
            and 1 <= int(_bounds(x)[0]) <= decode.DECODE_QUERY_BOUND and not _shared_slot(x))


SERVED = [c.name for c in load_cases(op="PagedAttention") if _served(c)]


def test_enough_case_files_are_served():
    assert len(SERVED) >= 8, SERVED  # rotary (half / interleaved / partial), packed, windows, sinks, bf16, ...


@pytest.mark.parametrize("name", SERVED)
def test_case_file_through_the_fused_write(fused_on, name):
    case = load_cases([name])[0]
    inputs = {k: v.to(DEVICE) for k, v in case.inputs.items()}
    inputs["attention_metadata"] = _bounds(case.inputs)
    with scope.run_scope(distinct_slots=True):
        got = paged.paged_attention(inputs, outputs=list(case.expected), validate=False, **case.attrs)
    assert len(fused_on) == 1, "the fused route did not run"
    compare_case(case, {k: v.cpu() for k, v in got.items()})


def test_no_promise_no_fusion(fused_on):
    case = load_cases([SERVED[0]])[0]
    inputs = {k: v.to(DEVICE) for k, v in case.inputs.items()}
    inputs["attention_metadata"] = _bounds(case.inputs)
    got = paged.paged_attention(inputs, outputs=list(case.expected), validate=False, **case.attrs)
    assert fused_on == []  # outside a distinct-slots scope: the write's dedup path
    compare_case(case, {k: v.cpu() for k, v in got.items()})


def test_unknown_or_prefill_bounds_are_not_fused(fused_on):
    case = load_cases([SERVED[0]])[0]
    for meta in (None, torch.tensor([decode.DECODE_QUERY_BOUND + 1, 64], dtype=torch.int32)):
        inputs = {k: v.to(DEVICE) for k, v in case.inputs.items()}
        if meta is not None:
            inputs["attention_metadata"] = meta
        with scope.run_scope(distinct_slots=True):
            paged.paged_attention(inputs, outputs=list(case.expected), validate=False, **case.attrs)
    assert fused_on == []


# --- against the unfused launches, bit for bit --------------------------------------------------------------


def _step(seed, B, H, Hkv, D, BS, dtype, n_q_max, rot, packed):
    """A random decode step over a paged float cache: (raw q [N, H*D], k, v [N, Hkv*D], packed qkv or None, csl,
    past, table, key / value caches with the new slots poisoned, cos / sin or None, n_q list)."""
    g = torch.Generator().manual_seed(seed)
    n_q = [int(torch.randint(1, n_q_max + 1, (1,), generator=g)) for _ in range(B)]
    past = [int(torch.randint(0, 5 * BS, (1,), generator=g)) for _ in range(B)]
    mb = max(-(-(p + n) // BS) for p, n in zip(past, n_q)) + 1
    nb = B * mb + 2
    perm = torch.randperm(nb, generator=g)
    table = perm[:B * mb].reshape(B, mb).to(torch.int32)
    table[0, -1] = -1  # an unmapped tail entry
    N = sum(n_q)
    qkv = torch.randn(N, (H + 2 * Hkv) * D, generator=g).to(dtype)
    if packed:
        q, k, v = qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]
    else:
        q, k, v = (t.contiguous() for t in (qkv[:, :H * D], qkv[:, H * D:(H + Hkv) * D], qkv[:, (H + Hkv) * D:]))
    kc = torch.randn(nb, BS, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(nb, BS, Hkv, D, generator=g).to(dtype)
    for b in range(B):  # the slots the step writes: NaN until written
        for j in range(n_q[b]):
            p = past[b] + j
            kc[table[b, p // BS], p % BS] = float("nan")
            vc[table[b, p // BS], p % BS] = float("nan")
    csl = torch.tensor([0] + list(torch.tensor(n_q).cumsum(0)), dtype=torch.int32)
    cos = sin = None
    if rot:
        half = rot // 2
        ang = torch.arange(6 * BS + 16)[:, None] * 10000.0 ** (-torch.arange(half) / half)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return (dev(q), dev(k), dev(v), dev(qkv) if packed else None, dev(csl), dev(torch.tensor(past, dtype=torch.int32)),
            dev(table), dev(kc), dev(vc), dev(cos), dev(sin), n_q)


def _attend(q, k, v, csl, past, table, kc, vc, cos, sin, *, H, Hkv, D, fused, interleaved=False, offset=0,
            splits=None, window=0, max_q=8):
    common_kw = dict(key_cache=kc, value_cache=vc, k_format=FLOAT, v_format=FLOAT, cumulative_sequence_length=csl,
                     past_seqlens=past, block_table=table, num_heads=H, kv_num_heads=Hkv, head_size=D,
                     v_head_size=D, scale=1.0 / math.sqrt(D), k_scale=None, v_scale=None, k_scale_cache=None,
                     v_scale_cache=None, query_positions=None, softcap=0.0, local_window_size=window,
                     is_causal=True, head_sink=None, attention_bias=None, qk_output=0, v_rotation=False,
                     max_query_len=max_q, max_kv_len=0, num_splits=splits)
    if fused:
        fw = decode.FusedWrite(k, v, cos, sin, interleaved, offset)
        return decode._paged_decode(q, fused=fw, **common_kw)[0]
    qr = write_kv(q, k, v, num_heads=H, kv_num_heads=Hkv, head_size=D, cumulative_sequence_length=csl,
                  past_seqlens=past, block_table=table, key_cache=kc, value_cache=vc, k_format=FLOAT,
                  v_format=FLOAT, cos_cache=cos, sin_cache=sin, rotary_interleaved=interleaved,
                  rotary_offset=offset, unique_slots=True)
    return decode._paged_decode(qr, **common_kw)[0]


CASES = [  # (B, H, Hkv, D, BS, dtype, n_q_max, rotary dim, packed, interleaved, offset, window)
    (3, 8, 2, 64, 16, torch.float16, 1, 64, True, False, 0, 0),
    (4, 4, 4, 32, 16, torch.bfloat16, 3, 32, False, True, 0, 0),
    (2, 8, 2, 64, 32, torch.float16, 8, 32, True, False, 16, 0),
    (3, 6, 2, 16, 16, torch.bfloat16, 2, 0, True, False, 0, 0),
    (2, 4, 1, 64, 64, torch.float16, 4, 64, False, False, 0, 40),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_fused_equals_the_unfused_launches(case, splits):
    B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[case]
    q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(case, B, H, Hkv, D, BS, dtype, nq, rot, packed)
    kw = dict(H=H, Hkv=Hkv, D=D, interleaved=inter, offset=off, splits=splits, window=win)
    kc2, vc2 = kc.clone(), vc.clone()
    want = _attend(q, k, v, csl, past, table, kc, vc, cos, sin, fused=False, **kw)
    got = _attend(q, k, v, csl, past, table, kc2, vc2, cos, sin, fused=True, **kw)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    # the caches: equal everywhere (the new slots written, NaN elsewhere kept: compare bit patterns)
    assert torch.equal(kc2.view(torch.int16), kc.view(torch.int16))
    assert torch.equal(vc2.view(torch.int16), vc.view(torch.int16))


@pytest.mark.parametrize("wrong", ["no_rope", "pairing", "unwritten"])
def test_teeth(wrong):
    B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[2]
    q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(2, B, H, Hkv, D, BS, dtype, nq, rot, packed)
    kw = dict(H=H, Hkv=Hkv, D=D, offset=off, splits=3, window=win)
    kc2, vc2 = kc.clone(), vc.clone()
    want = _attend(q, k, v, csl, past, table, kc, vc, cos, sin, fused=False, **kw)
    if wrong == "unwritten":  # what a launch that skipped the write reads: the poisoned new slots
        qr = write_kv(q, k, v, num_heads=H, kv_num_heads=Hkv, head_size=D, cumulative_sequence_length=csl,
                      past_seqlens=past, block_table=table, key_cache=kc2.clone(), value_cache=vc2.clone(),
                      k_format=FLOAT, v_format=FLOAT, cos_cache=cos, sin_cache=sin, rotary_offset=off,
                      unique_slots=True)  # q only: the caches written are copies
        got = decode._paged_decode(qr, key_cache=kc2, value_cache=vc2, k_format=FLOAT, v_format=FLOAT,
                                   cumulative_sequence_length=csl, past_seqlens=past, block_table=table,
                                   num_heads=H, kv_num_heads=Hkv, head_size=D, v_head_size=D,
                                   scale=1.0 / math.sqrt(D), k_scale=None, v_scale=None, k_scale_cache=None,
                                   v_scale_cache=None, query_positions=None, softcap=0.0, local_window_size=0,
                                   is_causal=True, head_sink=None, attention_bias=None, qk_output=0,
                                   v_rotation=False, max_query_len=8, max_kv_len=0, num_splits=3)[0]
        assert torch.isfinite(want).all() and not torch.isfinite(got).all()
        return
    if wrong == "no_rope":
        cos = sin = None
    got = _attend(q, k, v, csl, past, table, kc2, vc2, cos, sin, fused=True, interleaved=wrong == "pairing", **kw)
    rel = float((got.double() - want.double()).abs().max() / want.double().abs().max())
    assert rel > 1e-2


def test_refusals_are_named():
    B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[0]
    q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(0, B, H, Hkv, D, BS, dtype, nq, rot, packed)
    with pytest.raises(ValueError, match="float caches in the query's dtype"):
        _attend(q, k, v, csl, past, table, kc.bfloat16(), vc.bfloat16(), cos, sin, fused=True, H=H, Hkv=Hkv, D=D)
    with pytest.raises(ValueError, match=r"fused key should be \["):
        _attend(q, k[:, :D], v, csl, past, table, kc, vc, cos, sin, fused=True, H=H, Hkv=Hkv, D=D)
    with pytest.raises(ValueError, match="rotary_offset \\+ rotary_dim"):
        _attend(q, k, v, csl, past, table, kc, vc, cos, sin, fused=True, H=H, Hkv=Hkv, D=D, offset=8)


@pytest.mark.parametrize("splits", [2, 5])
def test_a_low_query_bound_costs_speed_not_correctness(splits):
    """attention_metadata's bound below a sequence's query (8 tokens, bound 1: chunks of 4 rows): each split still
    writes the tiles it reads (the partition comes from the whole query), so the result is the unfused one up to
    the order the splits' partials combine in (the unfused launch partitions each chunk's own range)."""
    B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[2]
    q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(7, B, H, Hkv, D, BS, dtype, nq, rot, packed)
    assert max(n_q) > 4
    kw = dict(H=H, Hkv=Hkv, D=D, offset=off, splits=splits, max_q=1)
    kc2, vc2 = kc.clone(), vc.clone()
    want = _attend(q, k, v, csl, past, table, kc, vc, cos, sin, fused=False, **kw)
    got = _attend(q, k, v, csl, past, table, kc2, vc2, cos, sin, fused=True, **kw)
    assert torch.isfinite(got).all()
    assert float((got.double() - want.double()).abs().max() / want.double().abs().max()) <= 4e-3
    assert torch.equal(kc2.view(torch.int16), kc.view(torch.int16))
    assert torch.equal(vc2.view(torch.int16), vc.view(torch.int16))


def test_custom_op_passes_opcheck():
    B, H, Hkv, D, BS, dtype, nq, rot, packed, inter, off, win = CASES[0]
    q, k, v, qkv, csl, past, table, kc, vc, cos, sin, n_q = _step(0, B, H, Hkv, D, BS, dtype, nq, rot, packed)
    args = (q, k, v, csl, past, table, kc, vc, cos, sin, None, None)
    kw = dict(num_heads=H, kv_num_heads=Hkv, head_size=D, scale=D ** -0.5, softcap=0.0, local_window_size=0,
              is_causal=True, rotary_interleaved=False, rotary_offset=0, max_query_len=1, max_kv_len=0)
    torch.library.opcheck(torch.ops.pagedkit.write_decode.default, args, kw,
                          test_utils=("test_schema", "test_faketensor"))


# --- the engine over the fused write, in the interpreter ----------------------------------------------------

CPU_VARIANT = __import__("dataclasses").replace(paged.VARIANT, name="triton_paged_interpreted", devices=("cpu",))


@pytest.mark.skipif(DEVICE != "cpu", reason="the Triton kernels on CPU tensors: the interpreter")
def test_engine_tokens_through_the_fused_write_equal_the_reference_engine(tiny_llama, fused_on, monkeypatch):
    """The engine (padded decode plans with replay-wide bounds, the distinct-slots promise, pad rows on the pad
    block) with PagedAttention on the Triton kernels in the interpreter and the fused write on: the same greedy
    tokens as the engine on the loop reference, except at near-ties of the reference's logits; the decode steps
    went through the fused route."""
    from pagedkit.kernels import dispatch
    from pagedkit.engine import Engine, SamplingParams

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")  # pagedkit's own ops, attention through dispatch
    prompts = [[5, 9, 17, 33, 2 + i] * (2 + i) for i in range(3)]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64, cuda_graphs="padded").generate(prompts, sp)
    spec = f"{__name__}:CPU_VARIANT"
    dispatch.register_variant(spec, before="torch_planned")
    try:
        eng = Engine(tiny_llama, max_batch_size=4, max_num_tokens=64, cuda_graphs="padded")
        got = eng.generate(prompts, sp)
        ran = set(eng.model.session.last_run_variants.values())
    finally:
        dispatch.unregister_variant(spec)
    assert ran == {"triton_paged_interpreted"}, ran
    assert len(fused_on) >= 2 * 5  # 2 layers x the decode steps
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
