"""The vectorized torch PagedAttention (pagedkit.kernels.paged.torch_sdpa, variant "torch_sdpa") against the
loop-based reference, which stays the oracle.

Every PagedAttention case file and randomized configurations (ragged batches, decode batches, speculative
steps, windows with unmapped leading blocks, quantized caches, LATENT, softcap / sink / bias / output_qk,
slot_mapping with -1 and shared slots, chunked prefill, rolling-window rings): output within
max|diff| <= 1e-5 x max|ref| in float32 (output_dtype=float32; the T output is that rounded), output_qk
likewise with the same zero pattern, caches bit-identical. The variant's output buffer is poisoned (NaN)
where it allocates it, and cache entries no sequence can admit hold NaN (float caches / scale caches),
so an unwritten row or a stale cache byte reaching the math shows up.
"""

from __future__ import annotations

import pytest
import torch

from cases import compare_case, load_cases
from nodes import make_paged_case
from pagedkit.kernels import dispatch
from pagedkit.kernels.paged import reference
from pagedkit.kernels.paged import torch_sdpa as torch_paged

TOL_F32 = 1e-5  # float32 outputs: summation order only
TOL_T = 2e-3  # fp16 outputs: rounding is 2**-11 of the largest element
_RAW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@pytest.fixture(autouse=True)
def poison_allocations(monkeypatch):
    """Buffers the variant allocates with torch.empty start as NaN (ints: -7): an unwritten row shows."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(torch, "empty", empty)


def _clone(inputs: dict) -> dict:
    return {k: v.clone() for k, v in inputs.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_RAW[t.element_size()])


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    if ref.numel() == 0:
        return 0.0
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def poison_stale(inputs: dict, attrs: dict) -> int:
    """Write NaN into every float cache / scale-cache entry that no sequence of the step can admit
    (beyond its extent or in a block its table row does not map). Returns the number of poisoned slots."""
    table, past = inputs["block_table"].long(), inputs["past_seqlens"].long()
    csl = inputs["cumulative_sequence_length"].long()
    cache = inputs["key_cache"]
    nb, bs = cache.shape[0], cache.shape[1]
    live = torch.zeros(nb, bs, dtype=torch.bool)
    for b in range(len(past)):
        extent = int(past[b] + csl[b + 1] - csl[b])
        for p in range(extent):
            blk = int(table[b, p // bs])
            if 0 <= blk < nb:
                live[blk, p % bs] = True
    for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"):
        t = inputs.get(name)
        if t is None:
            continue
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8)[~live] = 0x7F  # e4m3fn NaN
        elif t.is_floating_point():
            t[~live] = float("nan")
    return int((~live).sum())


def check_against_reference(inputs: dict, attrs: dict, outputs: list[str], poison: bool = True, impl=None) -> dict:
    """Run the reference and the variant (impl: a variant's entry, default torch_sdpa's) on copies; assert the
    documented agreement; return the variant's."""
    impl = impl or torch_paged.paged_attention
    inputs = _clone(inputs)
    if poison:
        poison_stale(inputs, attrs)
    ref_x, got_x = _clone(inputs), _clone(inputs)
    ref = reference.paged_attention(ref_x, outputs=outputs, output_dtype=torch.float32, **attrs)
    got = impl(got_x, outputs=outputs, output_dtype=torch.float32, **attrs)
    assert set(got) == set(ref)
    assert got["output"].dtype == torch.float32 and got["output"].shape == ref["output"].shape
    assert torch.isfinite(ref["output"]).all()
    err = _rel(got["output"], ref["output"])
    assert err <= TOL_F32, f"output: max|diff| / max|ref| = {err:.3g} > {TOL_F32}"
    if "output_qk" in ref:
        assert got["output_qk"].shape == ref["output_qk"].shape and got["output_qk"].dtype == torch.float32
        err = _rel(got["output_qk"], ref["output_qk"])
        assert err <= TOL_F32, f"output_qk: {err:.3g} > {TOL_F32}"
        assert torch.equal(got["output_qk"] == 0, ref["output_qk"] == 0)
    for name in ref:
        if name.endswith("_out"):
            assert got[name] is got_x[name[:-4]], f"{name} should be its cache input, updated in place"
            assert torch.equal(_bits(got[name]), _bits(ref[name])), f"{name} differs from the reference"
    return got


def _case(**kw):
    attrs = kw.pop("attrs", {})
    kw.setdefault("num_heads", 8)
    kw.setdefault("kv_num_heads", 2)
    kw.setdefault("head_size", 32)
    case = make_paged_case(**kw)
    case.attrs.update(attrs)
    return case


# ------------------------------------------------------------------------------------------------
# case files
# ------------------------------------------------------------------------------------------------

PAGED_CASES = load_cases(op="PagedAttention")


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c.name for c in PAGED_CASES])
def test_case_file(case):
    info = dispatch.NodeInfo("PagedAttention", case.attrs, set(case.inputs), set(case.expected),
                             torch.device("cpu"))
    assert torch_paged.supports(info) is None
    got = torch_paged.paged_attention(_clone(case.inputs), outputs=list(case.expected), **case.attrs)
    compare_case(case, got, code_steps=0)
    if got["output"].dtype == torch.float16:
        ref = reference.paged_attention(_clone(case.inputs), outputs=list(case.expected), **case.attrs)
        assert _rel(got["output"], ref["output"]) <= TOL_T
    check_against_reference(case.inputs, case.attrs, list(case.expected), poison=False)
    check_against_reference(case.inputs, case.attrs, list(case.expected))


def test_every_case_file_is_served():
    assert len(PAGED_CASES) >= 25


# ------------------------------------------------------------------------------------------------
# randomized configurations
# ------------------------------------------------------------------------------------------------

RAGGED = dict(past=(0, 5, 37, 16, 9), q_lens=(20, 1, 3, 0, 2))
DECODE = dict(past=(3, 50, 17, 0, 64, 31, 100, 1), q_lens=(1,) * 8)
SPEC = dict(past=(12, 40, 0, 77), q_lens=(4, 4, 4, 4))
CONFIGS = {
    "ragged": RAGGED,
    "ragged_bf16_packed": dict(RAGGED, dtype=torch.bfloat16, packed=True),
    "decode": DECODE,
    "decode_mqa_block32": dict(DECODE, kv_num_heads=1, block_size=32),
    "decode_mixed_widths": dict(past=(2, 300, 5, 40, 700, 17, 299), q_lens=(1,) * 7),  # several decode groups
    "decode_no_gqa": dict(DECODE, num_heads=4, kv_num_heads=4),
    "speculative_steps": SPEC,
    "qk_norm_rotation": dict(RAGGED, qk_norm=True, rotation=True),
    "rotary_partial_offset": dict(RAGGED, rotary_dim=16, rotary_offset=8),
    "no_rotary": dict(DECODE, rotary=False),
    "query_positions": dict(RAGGED, query_positions=True),
    "softcap_sink": dict(RAGGED, head_sink=True, attrs={"softcap": 20.0}),
    "bias_scores": dict(RAGGED, bias=True, qk_output=1),
    "bias_probs_sink_decode": dict(DECODE, bias=True, head_sink=True, qk_output=2),
    "all_features": dict(RAGGED, dtype=torch.bfloat16, slot_mapping=True, head_sink=True, qk_norm=True,
                         metadata=True, query_positions=True, bias=True, qk_output=2, attrs={"softcap": 25.0}),
    "custom_scale_non_causal": dict(SPEC, scale=0.3, attrs={"is_causal": 0}),
    "latent": dict(RAGGED, latent=True, num_heads=4, kv_num_heads=1, head_size=96, v_head_size=64,
                   rotary_offset=64, rotary_dim=32, scale=0.1),
    "latent_int8_per_tensor": dict(DECODE, latent=True, num_heads=4, kv_num_heads=1, head_size=96,
                                   v_head_size=64, rotary_offset=64, rotary_dim=32, scale=0.1, cache="int8",
                                   quant="PER_TENSOR"),
    "latent_int4_per_token_sink_free_qk": dict(RAGGED, latent=True, num_heads=4, kv_num_heads=1, head_size=96,
                                               v_head_size=64, rotary_offset=64, rotary_dim=32, scale=0.1,
                                               cache="int4", quant="PER_TOKEN", qk_output=1),
}
for _cache in ("int8", "fp8", "int4"):
    for _quant in ("PER_TENSOR", "PER_CHANNEL", "PER_TOKEN"):
        CONFIGS[f"{_cache}_{_quant.lower()}"] = dict(RAGGED, cache=_cache, quant=_quant)
        CONFIGS[f"{_cache}_{_quant.lower()}_decode"] = dict(DECODE, cache=_cache, quant=_quant)
CONFIGS["int8_per_token_f32_scales_rotation"] = dict(RAGGED, cache="int8", quant="PER_TOKEN", rotation=True,
                                                     scale_cache_dtype=torch.float32)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_configuration(name, seed):
    case = _case(seed=seed, **CONFIGS[name])
    check_against_reference(case.inputs, case.attrs, case.outputs)


WINDOW_SHAPES = {
    "decode": dict(past=(60, 5, 90, 33), q_lens=(1, 1, 1, 1)),
    "decode_every_block_offset": dict(past=tuple(range(40, 57)), q_lens=(1,) * 17),  # window starts at every offset
    "mixed": dict(past=(60, 5, 90), q_lens=(1, 4, 20)),
    "prefill": dict(past=(0, 40), q_lens=(45, 30)),
}


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("window", [1, 7, 16, 500])
@pytest.mark.parametrize("shape", sorted(WINDOW_SHAPES))
def test_window(shape, window, causal):
    case = _case(seed=window + causal, attrs={"local_window_size": window, "is_causal": causal},
                 **WINDOW_SHAPES[shape])
    check_against_reference(case.inputs, case.attrs, case.outputs)


@pytest.mark.parametrize("extra", [{}, {"query_positions": True}, {"cache": "int4", "quant": "PER_TOKEN"},
                                   {"head_sink": True, "qk_output": 2, "attrs": {"softcap": 10.0}}])
def test_window_with_unmapped_leading_blocks(extra):
    """The runtime unmaps blocks wholly below every window (design §9.3): -1 entries, never admitted."""
    extra = dict(extra)
    attrs = {"local_window_size": 20, **extra.pop("attrs", {})}
    case = _case(past=(70, 100, 3), q_lens=(1, 3, 2), seed=3, attrs=attrs, **extra)
    table, past = case.inputs["block_table"], case.inputs["past_seqlens"]
    unmapped = 0
    for b in range(table.shape[0]):
        below = max(0, int(past[b]) - 20 + 1) // 16  # blocks wholly below the earliest query's window
        table[b, :below] = -1
        unmapped += below
    assert unmapped >= 8
    check_against_reference(case.inputs, case.attrs, case.outputs)


@pytest.mark.parametrize("window", [-1, 5, 18])
@pytest.mark.parametrize("causal", [1, 0])
def test_query_positions_anywhere_in_the_context(causal, window, monkeypatch):
    """Explicit positions (not past + j) drive RoPE and the masks: the key range must not be clamped by
    the derived positions. Random positions in [0, extent), prefill rows chunked."""
    monkeypatch.setattr(torch_paged, "BUDGET", 2000)
    case = _case(past=(30, 0, 50, 7), q_lens=(1, 40, 3, 17), query_positions=True, seed=9 + window,
                 attrs={"is_causal": causal, "local_window_size": window})
    g = torch.Generator().manual_seed(window + 1)
    ext = [30 + 1, 40, 50 + 3, 7 + 17]
    pos = torch.cat([torch.randint(0, e, (n,), generator=g) for e, n in zip(ext, (1, 40, 3, 17))])
    case.inputs["query_positions"] = pos.to(torch.int32)
    check_against_reference(case.inputs, case.attrs, case.outputs)


@pytest.mark.parametrize("extra", [{}, {"qk_output": 1}, {"head_sink": True, "qk_output": 2}])
def test_row_with_no_admitted_key_outputs_zero(extra):
    """Sequence 1's current block is unmapped (its token writes nothing) and its window (3) lies in it."""
    case = _case(past=(10, 20, 5), q_lens=(2, 1, 1), seed=9, attrs={"local_window_size": 3}, **extra)
    case.inputs["block_table"][1, 1] = -1
    got = check_against_reference(case.inputs, case.attrs, case.outputs)
    assert torch.equal(got["output"][2], torch.zeros_like(got["output"][2]))
    assert got["output"][[0, 1, 3]].abs().amax(-1).gt(0).all()


@pytest.mark.parametrize("extra", [{}, {"head_sink": True, "bias": True, "qk_output": 1},
                                   {"attrs": {"local_window_size": 9}}])
def test_chunked_rows_and_split_groups(monkeypatch, extra):
    """A tiny score budget forces prefill row chunks and several decode groups."""
    monkeypatch.setattr(torch_paged, "BUDGET", 1000)
    extra = dict(extra)
    case = _case(past=(0, 30, 2, 45, 8, 19), q_lens=(41, 1, 1, 1, 18, 1), seed=5, attrs=extra.pop("attrs", {}),
                 **extra)
    items = torch_paged._work_items(_prepared(case))
    assert sum(len(s) == 1 and j1 - j0 < 41 and j1 - j0 > 0 for s, j0, j1 in items) >= 3  # prefill chunks
    assert sum(j1 == 1 for _, _, j1 in items) >= 2  # decode sequences in several groups
    check_against_reference(case.inputs, case.attrs, case.outputs)


def _prepared(case):
    from pagedkit.kernels.paged.prologue import prepare

    return prepare(_clone(case.inputs), case.attrs, case.outputs)


def test_slot_mapping_minus_one_and_shared_slots():
    """-1 writes nothing; of several tokens given one slot the last wins (both writes), unmapped blocks masked."""
    case = _case(past=(10, 20, 5), q_lens=(3, 2, 4), slot_mapping=True, seed=7, cache="int4", quant="PER_TOKEN")
    slots = case.inputs["slot_mapping"]
    slots[1] = -1
    slots[4] = -1
    slots[6] = slots[8]  # tokens 6 and 8 share a slot (8 wins); 8's own derived slot stays stale
    case.inputs["block_table"][1, 0] = -1  # sequence 1's first block unmapped: positions 0..15 masked
    got = check_against_reference(case.inputs, case.attrs, case.outputs, poison=False)
    assert torch.isfinite(got["output"]).all()


def test_ring_decode_steps_equal_reference_every_step():
    """Rolling-window ring (design §9.3): 2 sequences decode 60 steps over ceil(W/BS)+1 recycled blocks each
    through slot_mapping, block_table entries below the window -1; caches carried from step to step."""
    g = torch.Generator().manual_seed(11)
    h, hkv, d, bs, window, mb = 4, 2, 32, 16, 20, 5
    n_ring = -(-window // bs) + 1
    ring = [[b * n_ring + r for r in range(n_ring)] for b in range(2)]
    attrs = dict(num_heads=h, kv_num_heads=hkv, local_window_size=window, k_quant_type="PER_TOKEN",
                 v_quant_type="PER_TOKEN", k_cache_dtype="int4", v_cache_dtype="int4")
    state = {"key_cache": torch.randint(0, 256, (2 * n_ring, bs, hkv, d // 2), generator=g, dtype=torch.uint8),
             "value_cache": torch.randint(0, 256, (2 * n_ring, bs, hkv, d // 2), generator=g, dtype=torch.uint8),
             "k_scale_cache": torch.rand(2 * n_ring, bs, hkv, generator=g).half() + 0.1,
             "v_scale_cache": torch.rand(2 * n_ring, bs, hkv, generator=g).half() + 0.1}
    sink = torch.randn(h, generator=g).half()
    lengths, evicted = [0, 0], 0
    for step in range(60):
        q_lens = [5 if step == 0 else 1, 0 if step < 9 else (3 if step == 9 else 1)]
        past, n = list(lengths), sum(q_lens)
        table = torch.full((2, mb), -1, dtype=torch.int32)
        slots = []
        for b in range(2):
            length = past[b] + q_lens[b]
            lo = max(0, past[b] - window + 1) // bs
            for i in range(lo, (length - 1) // bs + 1 if length else 0):
                table[b, i] = ring[b][i % n_ring]
            evicted += int(lo > 0)
            slots += [ring[b][(p // bs) % n_ring] * bs + p % bs for p in range(past[b], length)]
        x = dict(query=torch.randn(n, h * d, generator=g).half(), key=torch.randn(n, hkv * d, generator=g).half(),
                 value=torch.randn(n, hkv * d, generator=g).half(), head_sink=sink, block_table=table,
                 past_seqlens=torch.tensor(past, dtype=torch.int32),
                 slot_mapping=torch.tensor(slots, dtype=torch.int32),
                 cumulative_sequence_length=torch.tensor([0, q_lens[0], n], dtype=torch.int32), **state)
        outs = ["output", "key_cache_out", "value_cache_out", "k_scale_cache_out", "v_scale_cache_out"]
        got = check_against_reference(x, attrs, outs, poison=False)
        state = {k: got[k + "_out"].clone() for k in state}
        lengths = [p + ql for p, ql in zip(past, q_lens)]
    assert evicted >= 40


def test_float64_compute_and_t_output():
    case = _case(seed=2, **RAGGED)
    ref = reference.paged_attention(_clone(case.inputs), outputs=["output"], compute_dtype=torch.float64,
                                    output_dtype=torch.float64, **case.attrs)
    got = torch_paged.paged_attention(_clone(case.inputs), outputs=["output"], compute_dtype=torch.float64,
                                      output_dtype=torch.float64, **case.attrs)
    assert got["output"].dtype == torch.float64
    assert _rel(got["output"], ref["output"]) <= 1e-12
    t_out = torch_paged.paged_attention(_clone(case.inputs), outputs=["output"], **case.attrs)["output"]
    f32 = torch_paged.paged_attention(_clone(case.inputs), outputs=["output"], output_dtype=torch.float32,
                                      **case.attrs)["output"]
    assert t_out.dtype == torch.float16 and torch.equal(t_out, f32.to(torch.float16))


# ------------------------------------------------------------------------------------------------
# errors, supports, dispatch
# ------------------------------------------------------------------------------------------------


def test_bad_index_values_are_clear_errors():
    case = _case(seed=1, slot_mapping=True, **RAGGED)
    case.inputs["slot_mapping"][2] = case.inputs["key_cache"].shape[0] * 16
    with pytest.raises(ValueError, match="input 'slot_mapping'"):
        torch_paged.paged_attention(_clone(case.inputs), **case.attrs)
    case = _case(seed=1, **RAGGED)
    case.inputs["block_table"] = case.inputs["block_table"][:, :1].contiguous()
    with pytest.raises(ValueError, match="input 'block_table'"):
        torch_paged.paged_attention(_clone(case.inputs), **case.attrs)


def test_validate_false_keeps_the_index_guards():
    """Without the contract validator (a session validated the node) no index input can make a read or
    write leave its tensor: the kernel's own guards name the input."""
    base = _case(seed=1, slot_mapping=True, query_positions=True, **RAGGED)
    good = torch_paged.paged_attention(_clone(base.inputs), outputs=["output"], validate=False, **base.attrs)
    ref = reference.paged_attention(_clone(base.inputs), outputs=["output"], **base.attrs)
    assert _rel(good["output"], ref["output"]) <= TOL_T
    nb, bs = base.inputs["key_cache"].shape[:2]
    bad = {
        "slot_mapping": ("slot_mapping", lambda x: x["slot_mapping"].__setitem__(2, nb * bs)),
        "past_seqlens": ("past_seqlens", lambda x: x["past_seqlens"].__setitem__(1, -3)),
        "query_positions": ("query_positions", lambda x: x["query_positions"].__setitem__(0, -1)),
        "cumulative_sequence_length": ("cumulative_sequence_length",
                                       lambda x: x["cumulative_sequence_length"].__setitem__(2, 0)),
        "cos_cache": ("cos_cache", lambda x: x["query_positions"].__setitem__(0, x["cos_cache"].shape[0])),
    }
    for what, (name, mutate) in bad.items():
        x = _clone(base.inputs)
        mutate(x)
        with pytest.raises(ValueError, match=f"input '{name}'"):
            torch_paged.paged_attention(x, validate=False, **base.attrs)
    x = _clone(base.inputs)
    del x["slot_mapping"]
    x["block_table"] = x["block_table"][:, :1].contiguous()
    with pytest.raises(ValueError, match="input 'block_table'"):
        torch_paged.paged_attention(x, validate=False, **base.attrs)


def test_non_contiguous_caches_are_updated_in_place():
    """Caches that are strided views (here every other row of a larger buffer) are written through."""
    case = _case(seed=6, cache="int8", quant="PER_TOKEN", **RAGGED)
    x = {}
    for name, t in case.inputs.items():
        if name.endswith("cache") and name not in ("cos_cache", "sin_cache"):
            big = torch.zeros((2 * t.shape[0], *t.shape[1:]), dtype=t.dtype)
            big[::2] = t
            x[name] = big[::2]
            assert not x[name].is_contiguous()
        else:
            x[name] = t.clone()
    ref = reference.paged_attention(_clone(case.inputs), outputs=case.outputs, output_dtype=torch.float32,
                                    **case.attrs)
    got = torch_paged.paged_attention(x, outputs=case.outputs, output_dtype=torch.float32, **case.attrs)
    assert _rel(got["output"], ref["output"]) <= TOL_F32
    for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"):
        assert got[name + "_out"] is x[name]
        assert torch.equal(_bits(x[name]), _bits(ref[name + "_out"])), name


def _info(op_type="PagedAttention", device="cpu"):
    return dispatch.NodeInfo(op_type, {"num_heads": 8, "kv_num_heads": 2}, {"query"}, {"output"},
                             torch.device(device))


def test_supports_serves_paged_attention_on_cpu_and_cuda():
    assert torch_paged.supports(_info()) is None
    assert torch_paged.supports(_info(device="cuda")) is None


def test_supports_refuses_with_a_reason():
    why = torch_paged.supports(_info(op_type="GroupQueryAttention"))
    assert isinstance(why, str) and "GroupQueryAttention" in why
    why = torch_paged.supports(_info(device="meta"))
    assert isinstance(why, str) and "meta" in why


def test_dispatch_selects_the_variant_on_cpu():
    """A plain node goes to torch_planned (first in priority); one with a feature torch_planned does not
    serve (head_sink) comes here."""
    plain, _ = _case(seed=0, **DECODE).node()
    assert dispatch.select_variant(plain, None, torch.device("cpu")).name == "torch_planned"
    case = _case(seed=0, head_sink=True, **DECODE)
    node, _ = case.node()
    variant = dispatch.select_variant(node, None, torch.device("cpu"))
    assert variant.name == torch_paged.NAME == "torch_sdpa"
    call = dispatch.bind(node, None, torch.device("cpu"))
    feed = _clone(case.inputs)
    names = [n for n in call.in_names]
    outs = call.run([feed.get(n) if n else None for n in names])
    ref = reference.paged_attention(_clone(case.inputs), outputs=case.outputs, **case.attrs)
    got = dict(zip(call.out_names, outs))
    assert _rel(got["output"], ref["output"]) <= TOL_T
    assert got["key_cache_out"] is feed["key_cache"]


# ------------------------------------------------------------------------------------------------
# CUDA (run on the device: python -m pytest -q -m gpu tests/test_torch_paged.py)
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ragged", "decode", "speculative_steps", "all_features", "latent_int8_per_tensor",
                                  "int4_per_token", "fp8_per_channel_decode", "int8_per_tensor"])
def test_cuda_equals_cpu_reference(name):
    case = _case(seed=4, **CONFIGS[name])
    x = _clone(case.inputs)
    poison_stale(x, case.attrs)
    ref = reference.paged_attention(_clone(x), outputs=case.outputs, output_dtype=torch.float32, **case.attrs)
    dev = {k: v.cuda() for k, v in x.items()}
    got = torch_paged.paged_attention(dev, outputs=case.outputs, output_dtype=torch.float32, **case.attrs)
    assert got["output"].device.type == "cuda"
    assert _rel(got["output"], ref["output"]) <= TOL_F32
    if "output_qk" in ref:
        assert _rel(got["output_qk"], ref["output_qk"]) <= TOL_F32
    for name_out in ref:
        if name_out.endswith("_out"):
            assert got[name_out] is dev[name_out[:-4]]
            assert torch.equal(_bits(got[name_out].cpu()), _bits(ref[name_out]))
