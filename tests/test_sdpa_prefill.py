"""The first-prompt route (variant `sdpa_prefill`: triton_paged's cache-write prologue, then torch's fused
attention on the prompts gathered back from the cache) against the float64 loop oracle (tests/paged_oracle.py,
no pagedkit import). On the CPU the prologue runs in Triton's interpreter and the attention on SDPA's math
backend (route "math"); on CUDA the route is cuDNN or FlashAttention-2 ("cudnn" / "flash").

What must hold: equal-length first prompts proven by attention_metadata take the fused route and match the
oracle (output and the cache the prologue wrote); whatever the bounds do not prove (ragged lengths, no
metadata, a kv bound above the query bound, too few block-table columns) runs triton_paged's attention and
matches too; inputs that break what the bounds promise (a cached prefix, unmapped prompt blocks) give NaN,
never a silently different result; dispatch picks the variant for the plan hint "prefill" only and refuses
what it lacks. Teeth: a 2% wrong scale, causal dropped, RoPE dropped fail the bound.
"""

from __future__ import annotations

import pytest
import torch

from paged_oracle import Spec, build, clone_inputs, oracle, rel_err

triton = pytest.importorskip("triton")  # under CI a failure (conftest.py)

from pagedkit.kernels import dispatch  # noqa: E402
from pagedkit.kernels.triton import sdpa_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = ("cudnn", "flash") if DEVICE == "cuda" else ("math",)
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _case(b=2, m=20, **kw) -> tuple:
    spec = Spec(q_lens=kw.pop("q_lens", [m] * b), past=kw.pop("past", [0] * b), seed=kw.pop("seed", 11), **kw)
    return spec, build(spec)


def _run(case, metadata="tight", inputs=None, **override):
    x = {k: v.to(DEVICE) for k, v in clone_inputs(inputs or case.inputs).items()}
    lens = [p + q for p, q in zip(case.spec.past, case.spec.q_lens)]
    if metadata == "tight":
        metadata = [max(case.spec.q_lens), max(lens)]
    if metadata is not None:
        x["attention_metadata"] = torch.tensor(metadata, dtype=torch.int32)
    got = sdpa_prefill.paged_attention(x, outputs=["output", "key_cache_out", "value_cache_out"], validate=False,
                                       **(case.attrs | override))
    return x, {k: v.cpu() for k, v in got.items()}


def _check(case, got, what=""):
    ref = oracle(case)
    tol = TOL[case.spec.dtype]
    err = rel_err(got["output"], ref["output"])
    assert err <= tol, f"{what} output: max|diff| / max|ref| = {err:.3g} > {tol}"
    # the prologue wrote the step's K / V at each token's slot
    sp, table = case.spec, case.inputs["block_table"]
    t = 0
    for b, n in enumerate(sp.q_lens):
        for i in range(n):
            pos = sp.past[b] + i
            blk = int(table[b, pos // sp.block_size])
            for side, name in (("k", "key_cache_out"), ("v", "value_cache_out")):
                row = got[name][blk, pos % sp.block_size].double()
                e = rel_err(row, ref[f"{side}_new"][t])
                assert e <= tol, f"{what} {name} token {t}: {e:.3g} > {tol}"
            t += 1
    return err


FUSED_CASES = [
    ("causal_rotary_gqa", dict(rotary="half")),
    ("bf16_interleaved", dict(rotary="interleaved", dtype=torch.bfloat16)),
    ("packed_qk_norm", dict(packed=True, qk_norm=True, rotary="half")),
    ("bidirectional", dict(attrs=dict(is_causal=0))),
    ("custom_scale_block32", dict(block_size=32, attrs=dict(scale=0.3))),
    ("one_block_exact", dict(m=16)),
    ("mha", dict(num_heads=2, kv_num_heads=2, m=9, b=3)),
]


@pytest.mark.parametrize("name,kw", FUSED_CASES, ids=[c[0] for c in FUSED_CASES])
def test_equal_first_prompts_take_the_fused_route_and_match_the_oracle(name, kw):
    _, case = _case(seed=100 + len(name), **kw)
    x, got = _run(case)
    assert sdpa_prefill.LAST_ROUTE in FUSED
    _check(case, got, name)
    assert got["key_cache_out"].data_ptr() != 0 and x["key_cache"].dtype == case.inputs["key_cache"].dtype


@pytest.mark.parametrize("what,kw,metadata", [
    ("ragged", dict(q_lens=[20, 7]), "tight"),
    ("no_metadata", dict(), None),
    ("kv_bound_above_q_bound", dict(), [20, 21]),
    ("unknown_kv_bound", dict(), [20, 0]),
])
def test_what_the_bounds_do_not_prove_runs_triton_paged(what, kw, metadata):
    _, case = _case(rotary="half", seed=200 + len(what), **kw)
    _, got = _run(case, metadata)
    assert sdpa_prefill.LAST_ROUTE == "triton_paged"
    _check(case, got, what)


def test_broken_promises_give_nan_not_a_different_result():
    # a cached prefix under bounds that claim none (the caller's metadata lies): NaN, not attention without it
    _, case = _case(past=[5, 0], q_lens=[20, 20], seed=301)
    _, got = _run(case, [20, 20])
    assert sdpa_prefill.LAST_ROUTE in FUSED and bool(got["output"].isnan().all())
    # a prompt block left unmapped (the contract masks it): NaN
    _, case = _case(unmapped=((1, 1),), seed=302)
    _, got = _run(case)
    assert bool(got["output"].isnan().all())
    # a prompt block id past the pool (num_blocks): NaN, not an index error
    _, case = _case(seed=304)
    table = case.inputs["block_table"].clone()
    table[1, 1] = case.inputs["key_cache"].shape[0]
    _, got = _run(case, inputs=clone_inputs(case.inputs) | {"block_table": table})
    assert sdpa_prefill.LAST_ROUTE in FUSED and bool(got["output"].isnan().all())
    # the same prompts with correct inputs: finite and right (the check above is not always NaN)
    _, case = _case(seed=303)
    _, got = _run(case)
    assert not bool(got["output"].isnan().any())
    _check(case, got)


@pytest.mark.parametrize("override", [{"scale": 1.02 / 4.0}, {"is_causal": 0}, {"do_rotary": 0}],
                         ids=["scale_2pct", "causal_dropped", "rotary_dropped"])
def test_teeth(override):
    _, case = _case(rotary="half", seed=401)
    _, got = _run(case, **override)
    assert sdpa_prefill.LAST_ROUTE in FUSED
    with pytest.raises(AssertionError):
        _check(case, got, str(override))


@pytest.mark.parametrize("override,why", [({"softcap": 5.0}, "softcap"), ({"local_window_size": 4}, "local_window"),
                                          ({"qk_output": 1}, "output_qk")])
def test_a_direct_call_refuses_what_the_route_lacks(override, why):
    _, case = _case(seed=501)
    with pytest.raises(NotImplementedError, match="sdpa_prefill"):
        _run(case, **override)


def test_int8_cache_and_sink_are_refused_by_direct_calls():
    _, case = _case(cache="int8", k_quant="PER_TENSOR", v_quant="PER_TENSOR", seed=502)
    with pytest.raises(NotImplementedError, match="quantized cache"):
        _run(case)
    _, case = _case(sink=True, seed=503)
    with pytest.raises(NotImplementedError, match="head_sink"):
        _run(case)


def test_dispatch_picks_it_for_prefill_plans_only_and_refuses_by_feature():
    from nodes import make_paged_case

    cuda = torch.device("cuda")  # binding reads no tensor: no GPU needed
    node, vi = make_paged_case(past=(0, 0), q_lens=(8, 8), metadata=True, seed=601).node()
    call = dispatch.bind(node, None, cuda, value_info=vi)
    assert call.report()["serving"][:2] == ["sdpa_prefill", "triton_paged"]
    assert call.pick("prefill").name == "sdpa_prefill"
    assert call.pick(None).name == "triton_paged"  # a mixed step: the general kernel
    assert call.pick("decode").name == "triton_paged" and call.pick("chunked_prefill").name == "triton_paged"
    with_sink, vi = make_paged_case(past=(0, 0), q_lens=(8, 8), head_sink=True, seed=602).node()
    refused = dispatch.bind(with_sink, None, cuda, value_info=vi).refused["sdpa_prefill"]
    assert "head_sink" in refused
    quant, vi = make_paged_case(past=(0, 0), q_lens=(8, 8), cache="int8", quant="PER_TENSOR", seed=603).node()
    assert "int8_cache" in dispatch.bind(quant, None, cuda, value_info=vi).refused["sdpa_prefill"]
    assert sdpa_prefill.uniform_prompt_len(16, 2, 8, 8) == 8
    assert sdpa_prefill.uniform_prompt_len(16, 2, 8, 9) is None  # a kv bound above the query bound: a prefix
    assert sdpa_prefill.uniform_prompt_len(15, 2, 8, 8) is None  # ragged
    assert sdpa_prefill.uniform_prompt_len(16, 2, 0, 0) is None  # unknown bounds


# ---- on the H200: real shapes, the fused route, capture ---------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_real_shapes_on_the_fused_route(dtype, block_size):
    _, case = _case(b=2, m=1000, num_heads=32, kv_num_heads=8, head_size=128, block_size=block_size,
                    rotary="half", dtype=dtype, seed=700 + block_size)
    _, got = _run(case)
    assert sdpa_prefill.LAST_ROUTE in ("cudnn", "flash")
    _check(case, got, f"{dtype} block {block_size}")


@pytest.mark.gpu
def test_the_fused_route_captures_and_replays_exactly():
    _, case = _case(b=2, m=300, num_heads=32, kv_num_heads=8, head_size=128, block_size=16, rotary="half",
                    seed=801)
    x = {k: v.cuda() for k, v in clone_inputs(case.inputs).items()}
    x["attention_metadata"] = torch.tensor([300, 300], dtype=torch.int32)

    def call():
        return sdpa_prefill.paged_attention(x, outputs=["output"], validate=False, **case.attrs)["output"]

    eager = call().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert sdpa_prefill.LAST_ROUTE in ("cudnn", "flash")
    assert torch.equal(out, eager)
    _check(case, {"output": out.cpu(), "key_cache_out": x["key_cache"].cpu(), "value_cache_out": x["value_cache"].cpu()})


def test_no_fused_backend_falls_back_to_triton_paged(monkeypatch):
    """A GPU / build where no fused SDPA backend takes the call: the Triton attention, same result."""
    monkeypatch.setattr(sdpa_prefill, "fused_sdpa", lambda *a, **k: (None, "no backend (test)"))
    _, case = _case(rotary="half", seed=901)
    _, got = _run(case)
    assert sdpa_prefill.LAST_ROUTE == "triton_paged"
    _check(case, got, "fallback")
