"""Paging semantics of the PagedAttention reference (design §17.2, §9.3): slot_mapping, -1 slots,
shuffled / shared / unmapped blocks, ragged batches, token_count 0, rolling sliding-window rings.

Most checks are bit-for-bit: the same logical context reached through a different paging must give the
same bytes. Feature correctness against the float64 oracle lives in test_reference_paged.py.
"""

import math

import torch

from paged_oracle import Spec, build, clone_inputs, oracle, rel_err
from pagedkit.kernels import paged_attention

H, HKV, D, BS = 4, 2, 16, 16


def _derived_slots(x) -> torch.Tensor:
    """The test's own derivation: token j of sequence b -> block_table[b][p // BS] * BS + p % BS."""
    csl, past, table = x["cumulative_sequence_length"], x["past_seqlens"], x["block_table"]
    bs = x["key_cache"].shape[1]
    slots = []
    for b in range(len(past)):
        for j in range(int(csl[b + 1] - csl[b])):
            p = int(past[b]) + j
            slots.append(int(table[b, p // bs]) * bs + p % bs)
    return torch.tensor(slots, dtype=torch.int32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _run(x, attrs, **kw):
    return paged_attention(x, **attrs, **kw)


def _spec(**kw):
    return Spec(q_lens=[3, 0, 5, 1], past=[10, 4, 0, 20], num_heads=H, kv_num_heads=HKV, head_size=D, **kw)


# ---------------------------------------------------------------------------------------------
# slot_mapping
# ---------------------------------------------------------------------------------------------


def test_explicit_slot_mapping_equal_to_derived_changes_nothing():
    for spec in (_spec(rotary="half"), _spec(cache="int4", k_quant="PER_TOKEN", v_quant="PER_TOKEN", seed=1)):
        case = build(spec)
        a = _run(clone_inputs(case.inputs), case.attrs)
        x = clone_inputs(case.inputs)
        x["slot_mapping"] = _derived_slots(x)
        b = _run(x, case.attrs)
        assert set(a) == set(b)
        for name in a:
            assert torch.equal(_bytes(a[name]), _bytes(b[name])), name


def test_minus_one_slots_leave_the_cache_byte_identical():
    case = build(_spec(cache="int8", k_quant="PER_TOKEN", v_quant="PER_TENSOR", seed=2))
    before = clone_inputs(case.inputs)
    x = clone_inputs(case.inputs)
    slots = _derived_slots(x)
    skipped = [0, 2, 4, 8]
    slots[skipped] = -1
    x["slot_mapping"] = slots
    res = _run(x, case.attrs)
    full = _run(clone_inputs(case.inputs), case.attrs)  # writes every token
    for name, cache in (("key_cache", res["key_cache_out"]), ("value_cache", res["value_cache_out"]),
                        ("k_scale_cache", res["k_scale_cache_out"])):
        written = full[name + "_out"]
        flat_b, flat_r, flat_w = (t.flatten(0, 1) for t in (before[name], cache, written))
        for t, s in enumerate(_derived_slots(before).tolist()):
            want = flat_b[s] if t in skipped else flat_w[s]
            assert torch.equal(_bytes(flat_r[s]), _bytes(want)), (name, t)
        others = torch.ones(flat_b.shape[0], dtype=torch.bool)
        others[_derived_slots(before).long()] = False
        assert torch.equal(_bytes(flat_r[others]), _bytes(flat_b[others])), name
    assert not torch.equal(_bytes(res["key_cache_out"]), _bytes(full["key_cache_out"]))


def test_minus_one_slots_match_a_prepopulated_run():
    """Prefix cache: sequence A cached a 16-token prefix; sequence B with the same prompt maps that block
    and skips its writes (-1); it must equal B computing everything into private blocks."""
    g = torch.Generator().manual_seed(3)
    n, nb = 21, 8
    q = torch.randn(n, H * D, generator=g).half()
    k = torch.randn(n, HKV * D, generator=g).half()
    v = torch.randn(n, HKV * D, generator=g).half()
    cos = torch.randn(64, D // 2, generator=g).half()
    sin = torch.randn(64, D // 2, generator=g).half()
    attrs = dict(num_heads=H, kv_num_heads=HKV, do_rotary=1)
    i32 = lambda *v: torch.tensor(v[0] if len(v) == 1 and isinstance(v[0], list) else v,  # noqa: E731
                                  dtype=torch.int32)
    kc0 = torch.randn(nb, BS, HKV, D, generator=g).half()
    vc0 = torch.randn(nb, BS, HKV, D, generator=g).half()

    def call(kc, vc, rows, table, slots=None):
        x = dict(query=q[rows], key=k[rows], value=v[rows], key_cache=kc, value_cache=vc,
                 cumulative_sequence_length=i32(0, len(rows)), past_seqlens=i32(0), block_table=table,
                 cos_cache=cos, sin_cache=sin)
        if slots is not None:
            x["slot_mapping"] = slots
        return _run(x, attrs)

    prefix = list(range(16))
    kc, vc = kc0.clone(), vc0.clone()
    call(kc, vc, prefix, i32([5, -1])[None])  # sequence A populates block 5 with the shared prefix
    hit = call(kc, vc, list(range(n)), i32([5, 2])[None],
               i32(*([-1] * 16), *[2 * BS + j for j in range(n - 16)]))
    miss = call(kc0.clone(), vc0.clone(), list(range(n)), i32([1, 2])[None])  # everything computed and written
    assert torch.equal(hit["output"], miss["output"])
    assert torch.equal(kc[5], miss["key_cache_out"][1]) and torch.equal(kc[2], miss["key_cache_out"][2])


# ---------------------------------------------------------------------------------------------
# block tables
# ---------------------------------------------------------------------------------------------


def _permute_blocks(x, perm: torch.Tensor):
    """The same logical content with physical block i moved to perm[i]."""
    y = clone_inputs(x)
    for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"):
        if name in x:
            moved = torch.empty_like(x[name])
            moved[perm] = x[name]
            y[name] = moved
    table = x["block_table"].long()
    y["block_table"] = torch.where(table >= 0, perm[table.clamp_min(0)], table).int()
    return y


def test_shuffled_blocks_are_bit_identical():
    for spec in (_spec(rotary="interleaved", sink=True, seed=4),
                 _spec(cache="float8e4m3fn", k_quant="PER_CHANNEL", v_quant="PER_TOKEN", seed=5)):
        case = build(spec)
        perm = torch.randperm(case.inputs["key_cache"].shape[0], generator=torch.Generator().manual_seed(6))
        a = _run(clone_inputs(case.inputs), case.attrs)
        b = _run(_permute_blocks(case.inputs, perm), case.attrs)
        assert torch.equal(a["output"], b["output"])
        moved = torch.empty_like(a["key_cache_out"])
        moved[perm] = a["key_cache_out"]
        assert torch.equal(_bytes(moved), _bytes(b["key_cache_out"]))


def test_shared_prefix_blocks():
    """Two sequences whose first block is one physical block equal the same run with private copies."""
    case = build(Spec(q_lens=[2, 3], past=[20, 17], num_heads=H, kv_num_heads=HKV, head_size=D, seed=7))
    x = clone_inputs(case.inputs)
    table = x["block_table"]
    p0, p1 = int(table[0, 0]), int(table[1, 0])
    for name in ("key_cache", "value_cache"):
        x[name][p1] = x[name][p0]  # identical prefix content in two private blocks
    private = _run(clone_inputs(x), case.attrs)
    shared = clone_inputs(x)
    shared["block_table"][1, 0] = p0
    res = _run(shared, case.attrs)
    assert torch.equal(res["output"], private["output"])
    assert torch.equal(res["key_cache_out"][p0], x["key_cache"][p0])  # the shared block is only read


def test_unmapped_entries_are_masked():
    """Entries < 0 and >= num_blocks both mean "unmapped": same bytes, and the oracle agrees."""
    spec = Spec(q_lens=[3, 0, 5, 1], past=[20, 4, 0, 20], num_heads=H, kv_num_heads=HKV, head_size=D,
                extra_cols=2, unmapped=((0, 0), (3, 0)), attrs={"qk_output": 1}, seed=8)
    case = build(spec)
    exp = oracle(case)
    minus = _run(clone_inputs(case.inputs), case.attrs)
    assert rel_err(minus["output"], exp["output"]) <= 2e-3
    big = clone_inputs(case.inputs)
    nb = big["key_cache"].shape[0]
    big["block_table"][big["block_table"] == -1] = nb + 7
    big["block_table"][0, -1] = nb  # exactly num_blocks
    out_big = _run(big, case.attrs)
    assert torch.equal(out_big["output"], minus["output"])
    assert torch.equal(out_big["output_qk"], minus["output_qk"])
    assert float(minus["output_qk"][:, 0:3, :16].abs().max()) == 0.0  # seq 0's first block contributes nothing


def test_ragged_batch_equals_sequences_run_alone():
    case = build(Spec(q_lens=[3, 0, 5, 1, 0], past=[10, 4, 0, 20, 0], num_heads=H, kv_num_heads=HKV, head_size=D,
                      rotary="half", qk_norm=True, seed=9))
    x = clone_inputs(case.inputs)
    res = _run(x, case.attrs)
    csl = case.inputs["cumulative_sequence_length"].tolist()
    single = clone_inputs(case.inputs)
    for b in range(5):
        t0, t1 = csl[b], csl[b + 1]
        xb = dict(single)
        xb.update(query=case.inputs["query"][t0:t1], key=case.inputs["key"][t0:t1],
                  value=case.inputs["value"][t0:t1],
                  cumulative_sequence_length=torch.tensor([0, t1 - t0], dtype=torch.int32),
                  past_seqlens=case.inputs["past_seqlens"][b:b + 1], block_table=case.inputs["block_table"][b:b + 1])
        rb = _run(xb, case.attrs)
        assert torch.equal(rb["output"], res["output"][t0:t1])
    assert torch.equal(single["key_cache"], res["key_cache_out"])  # the same writes, one at a time


def test_token_count_zero():
    case = build(Spec(q_lens=[0, 0], past=[5, 17], num_heads=H, kv_num_heads=HKV, head_size=D,
                      attrs={"qk_output": 2}, seed=10))
    before = clone_inputs(case.inputs)
    res = _run(clone_inputs(case.inputs), case.attrs)
    assert res["output"].shape == (0, H * D) and res["output"].dtype == torch.float16
    assert res["output_qk"].shape == (H, 0, case.inputs["block_table"].shape[1] * BS)
    assert torch.equal(res["key_cache_out"], before["key_cache"])
    assert torch.equal(res["value_cache_out"], before["value_cache"])


# ---------------------------------------------------------------------------------------------
# rolling sliding-window ring (§9.3)
# ---------------------------------------------------------------------------------------------


def _ring_vs_full(window: int, full_window: int, quant: dict, steps: int, prune_only: bool = False):
    """Two sequences decode side by side (seq 1 joins at step 9 with a 3-token prefill). The ring run holds
    ceil(W / BS) + 1 blocks per sequence, recycled through slot_mapping, evicted block_table entries -1;
    the full run holds every block and derives its slots. Returns (#steps compared, #steps past W,
    #(step, sequence) with evicted entries, #tokens written into a recycled ring block)."""
    g = torch.Generator().manual_seed(11)
    n_ring = min(math.ceil(window / BS) + 1, 8) if window > 0 else 8
    mb = 5  # covers 80 positions
    sink = torch.randn(H, generator=g).half() if quant.get("sink") else None
    attrs_full = dict(num_heads=H, kv_num_heads=HKV, local_window_size=full_window, **quant.get("attrs", {}))
    attrs_ring = dict(attrs_full, local_window_size=window)
    fmt = quant.get("cache")

    def fresh(nb):
        if fmt == "int4":
            c = lambda: torch.randint(0, 256, (nb, BS, HKV, D // 2), generator=g, dtype=torch.uint8)  # noqa: E731
            return {"key_cache": c(), "value_cache": c(),
                    "k_scale_cache": torch.rand(nb, BS, HKV, generator=g).half() + 0.1,
                    "v_scale_cache": torch.rand(nb, BS, HKV, generator=g).half() + 0.1}
        return {"key_cache": torch.randn(nb, BS, HKV, D, generator=g).half(),
                "value_cache": torch.randn(nb, BS, HKV, D, generator=g).half()}

    full_state, ring_state = fresh(2 * mb), fresh(2 * (mb if prune_only else n_ring))
    ring = [[b * n_ring + r for r in range(n_ring)] for b in range(2)]
    lengths, compared, past_w, evicted, recycled = [0, 0], 0, 0, 0, 0
    for step in range(steps):
        q_lens = [5 if step == 0 else 1, 0 if step < 9 else (3 if step == 9 else 1)]
        past = list(lengths)
        n = sum(q_lens)
        q, k, v = (torch.randn(n, w * D, generator=g).half() for w in (H, HKV, HKV))
        common = dict(query=q, key=k, value=v, past_seqlens=torch.tensor(past, dtype=torch.int32),
                      cumulative_sequence_length=torch.tensor([0, q_lens[0], n], dtype=torch.int32))
        if sink is not None:
            common["head_sink"] = sink
        full_table = torch.tensor([[b * mb + i for i in range(mb)] for b in range(2)], dtype=torch.int32)
        ring_table = torch.full((2, mb), -1, dtype=torch.int32)
        slots = []
        for b in range(2):
            length = past[b] + q_lens[b]
            lo = max(0, past[b] - window + 1) // BS if window > 0 else 0  # first block still reachable
            for i in range(lo, (length - 1) // BS + 1 if length else 0):
                ring_table[b, i] = ring[b][i % n_ring]
            evicted += int(lo > 0)
            recycled += sum(p // BS >= n_ring for p in range(past[b], length))
            slots += [ring[b][(p // BS) % n_ring] * BS + p % BS for p in range(past[b], length)]
        if prune_only:  # free-list pruning: the full cache with the unreachable entries unmapped
            ring_table = torch.where(ring_table >= 0, full_table, ring_table)
        full = _run(dict(common, block_table=full_table, **full_state), attrs_full)
        ring_x = dict(common, block_table=ring_table, **ring_state)
        if not prune_only:
            ring_x["slot_mapping"] = torch.tensor(slots, dtype=torch.int32)
        ringed = _run(ring_x, attrs_ring)
        assert torch.equal(ringed["output"], full["output"]), f"step {step}"
        compared += 1
        past_w += int(window > 0 and max(p + ql for p, ql in zip(past, q_lens)) > window)
        lengths = [p + ql for p, ql in zip(past, q_lens)]
    return compared, past_w, evicted, recycled


def test_rolling_window_ring_bit_identical_to_full_cache():
    compared, past_w, evicted, recycled = _ring_vs_full(20, 20, {}, steps=70)
    assert compared == 70 and past_w >= 30 and evicted >= 30 and recycled >= 20


def test_rolling_window_ring_quantized_with_sink():
    quant = {"cache": "int4", "sink": True,
             "attrs": {"k_quant_type": "PER_TOKEN", "v_quant_type": "PER_TOKEN", "k_cache_dtype": "int4",
                       "v_cache_dtype": "int4"}}
    _, past_w, evicted, recycled = _ring_vs_full(8, 8, quant, steps=40)
    assert past_w >= 20 and evicted >= 10 and recycled >= 5


def test_window_pruning_bit_identical():
    _, past_w, evicted, _ = _ring_vs_full(20, 20, {}, steps=40, prune_only=True)
    assert past_w >= 20 and evicted >= 5


def test_window_at_least_the_context_equals_full_attention():
    compared, _, evicted, recycled = _ring_vs_full(1000, -1, {}, steps=30)
    assert compared == 30 and evicted == 0 and recycled == 0
