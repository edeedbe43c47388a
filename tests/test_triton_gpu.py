"""The Triton PagedAttention kernels on the GPU at real shapes (32 / 8 heads, head 128), against the
independent float64 oracle (tests/paged_oracle.py: no pagedkit import): every cache type and feature,
block sizes 16 / 32 / 64 / 256, ragged batches mixing contexts 1 ... 32k; CUDA-graph capture of 8 decode
steps with a growing context equals eager bit for bit; attention_metadata absent / tight / loose agree,
and an under-sized bound still returns the exact result (the split ranges follow each sequence's real
extent; the bound only sizes the launch). Run on the device: `pytest -m gpu tests/test_triton_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from paged_oracle import Spec, build, clone_inputs, oracle, rel_err

pytestmark = pytest.mark.gpu

H, HKV, D = 32, 8, 128
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _paged():
    from pagedkit.kernels.triton import paged

    return paged


def _cuda(inputs: dict) -> dict:
    return {k: (v if k == "attention_metadata" else v.cuda()) for k, v in inputs.items()}


def _run(case, metadata=None, inputs=None):
    x = _cuda(inputs or case.inputs)
    if metadata is not None:
        x["attention_metadata"] = torch.tensor(metadata, dtype=torch.int32)
    outs = ["output", "key_cache_out"] + ([] if case.spec.latent else ["value_cache_out"])
    if case.attrs.get("qk_output"):
        outs.append("output_qk")
    got = _paged().paged_attention(x, outputs=outs, validate=False, **case.attrs)
    torch.cuda.synchronize()
    return x, got


def _check(case, got, what=""):
    ref = oracle(case)
    tol = TOL[case.spec.dtype]
    err = rel_err(got["output"].cpu(), ref["output"])
    assert err <= tol, f"{what} output: max|diff| / max|ref| = {err:.3g} > {tol}"
    if "output_qk" in got:
        err_qk = rel_err(got["output_qk"].cpu(), ref["output_qk"])
        assert err_qk <= tol, f"{what} output_qk: {err_qk:.3g} > {tol}"
    return err


RAGGED = [0, 1, 15, 16, 17, 255, 1000, 4095]
CACHES = [
    ("fp16", dict(cache="same")),
    ("bf16", dict(cache="same", dtype=torch.bfloat16)),
    ("int8_tensor", dict(cache="int8", k_quant="PER_TENSOR", v_quant="PER_TENSOR")),
    ("int8_channel", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
    ("int8_token", dict(cache="int8", k_quant="PER_TOKEN", v_quant="PER_TOKEN")),
    ("fp8_tensor", dict(cache="float8e4m3fn", k_quant="PER_TENSOR", v_quant="PER_TENSOR")),
    ("fp8_channel", dict(cache="float8e4m3fn", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
    ("fp8_token", dict(cache="float8e4m3fn", k_quant="PER_TOKEN", v_quant="PER_TOKEN",
                       scale_cache_dtype=torch.float32)),
    ("int4_tensor", dict(cache="int4", k_quant="PER_TENSOR", v_quant="PER_TENSOR")),
    ("int4_channel", dict(cache="int4", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
    ("int4_token_rotation", dict(cache="int4", k_quant="PER_TOKEN", v_quant="PER_TOKEN",
                                 attrs=dict(qk_rotation=1, v_rotation=1))),
]


@pytest.mark.parametrize("block_size", [16, 32, 64, 256])
@pytest.mark.parametrize("name,kw", CACHES, ids=[c[0] for c in CACHES])
def test_decode_every_cache_type_and_block_size(name, kw, block_size):
    spec = Spec(q_lens=[1] * len(RAGGED), past=RAGGED, num_heads=H, kv_num_heads=HKV, head_size=D,
                block_size=block_size, rotary="half", seed=block_size, **kw)
    case = build(spec)
    _, got = _run(case)
    _check(case, got, f"{name} block {block_size}")


FEATURES = [
    ("sink_softcap_qknorm_rotary", dict(sink=True, qk_norm=True, rotary="half", attrs=dict(softcap=30.0))),
    ("window", dict(rotary="half", attrs=dict(local_window_size=256))),
    ("window_1", dict(attrs=dict(local_window_size=1))),
    ("bidirectional_window", dict(q_lens=[4] * 8, attrs=dict(is_causal=0, local_window_size=300))),
    ("bias_scores", dict(bias=(True, True), attrs=dict(qk_output=1))),
    ("bias_broadcast_probs_sink", dict(bias=(False, False), sink=True, attrs=dict(qk_output=2))),
    ("interleaved_partial_rotary", dict(rotary="interleaved", rotary_dim=64)),
    ("query_positions", dict(rotary="half", query_positions=[p + 7 for p in RAGGED])),
    ("spec_drafts", dict(q_lens=[4] * 8, rotary="half")),
    ("chunked_prefill", dict(q_lens=[64, 1, 33, 1, 128, 1, 2, 16], rotary="half")),
    ("packed_qkv_unmapped", dict(packed=True, rotary="half", unmapped=((7, 0), (6, 3)))),
    ("mqa", dict(kv_num_heads=1)),
    ("latent_mla", dict(num_heads=16, kv_num_heads=1, head_size=576, latent=True, v_head_size=512,
                        rotary="half", rotary_dim=64, rotary_offset=512, attrs=dict(scale=0.07))),
]


@pytest.mark.parametrize("name,kw", FEATURES, ids=[f[0] for f in FEATURES])
def test_features(name, kw):
    kw = dict(kw)
    q_lens = kw.pop("q_lens", [1] * len(RAGGED))
    base = dict(num_heads=H, kv_num_heads=HKV, head_size=D, block_size=16)
    spec = Spec(q_lens=q_lens, past=RAGGED, **(base | kw))
    case = build(spec)
    _, got = _run(case)
    _check(case, got, name)


PREFILLS = [
    ("fp16", {}),
    ("bf16", dict(dtype=torch.bfloat16)),
    ("features", dict(sink=True, qk_norm=True, rotary="half", attrs=dict(softcap=30.0, local_window_size=200))),
    ("bidirectional", dict(attrs=dict(is_causal=0))),
    ("int8_token", dict(cache="int8", k_quant="PER_TOKEN", v_quant="PER_TOKEN")),
]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("name,kw", PREFILLS, ids=[p[0] for p in PREFILLS])
def test_prefills_on_query_chunk_lanes(name, kw, block_size):
    """Prefills run their query chunks on parallel programs with 128-row tiles (float caches): full prefills,
    one over a cached prefix (chunked prefill) and a decode token in one ragged step."""
    kw = dict(kw)
    if "k_quant" not in kw:
        shape = dict(q_lens=[300, 1, 517, 64], past=[0, 2000, 211, 0], num_heads=H, kv_num_heads=HKV)
    else:  # checked against the loop reference (a Python loop over rows x heads): a smaller step, still several
        # 128-row query chunks per prefill (over 250 s at the full size on the device's loaded CPU)
        shape = dict(q_lens=[200, 1, 300, 64], past=[0, 700, 150, 0], num_heads=8, kv_num_heads=2)
    spec = Spec(head_size=D, block_size=block_size, seed=5, **shape, **kw)
    case = build(spec)
    q_hi, kv_hi = max(shape["q_lens"]), max(q + p for q, p in zip(shape["q_lens"], shape["past"]))
    x, got = _run(case, metadata=[q_hi, kv_hi, 0], inputs=clone_inputs(case.inputs))
    if "k_quant" not in kw:
        _check(case, got, f"prefill {name} block {block_size}")
        return
    # quantized: a prefill's early tokens attend to a few keys, so one code the float64 oracle rounds the other
    # way at a tie (x / scale in float64 vs float32) moves the output by a whole step (1/127); the loop
    # reference rounds as the contract's kernels do (float32): the kernel must match it
    from pagedkit.kernels.paged.reference import paged_attention

    # on the CPU: the loop's thousands of tiny ops (each row x head) took over 200 s as CUDA launches beside
    # other test workers
    ref = paged_attention({k: v.cpu() for k, v in clone_inputs(case.inputs).items()},
                          outputs=["output", "key_cache_out", "value_cache_out", "k_scale_cache_out",
                                   "v_scale_cache_out"], **case.attrs)
    err = rel_err(got["output"].cpu(), ref["output"])
    assert err <= TOL[spec.dtype], f"prefill {name} block {block_size}: {err:.3g} vs the loop reference"
    for side in ("key_cache_out", "value_cache_out"):
        diff = (got[side].cpu().to(torch.int16) - ref[side].to(torch.int16)).abs()
        assert int(diff.max()) <= 1 and int((diff > 0).sum()) <= 1e-4 * diff.numel(), side


@pytest.mark.parametrize("block_size", [16, 256])
def test_ragged_long_contexts(block_size):
    past = [1, 100, 1000, 8000, 16383, 32767]
    case = build(Spec(q_lens=[1] * len(past), past=past, num_heads=H, kv_num_heads=HKV, head_size=D,
                      block_size=block_size, rotary="half", seed=3))
    _, got = _run(case)
    _check(case, got, f"ragged 1..32k block {block_size}")
    one = build(Spec(q_lens=[1], past=[32767], num_heads=H, kv_num_heads=HKV, head_size=D,
                     block_size=block_size, seed=4))
    _, got = _run(one)
    _check(one, got, "one sequence of 32k")


def test_metadata_absent_tight_loose_and_undersized_agree():
    past = [3, 700, 2047, 4000]
    case = build(Spec(q_lens=[1] * 4, past=past, num_heads=H, kv_num_heads=HKV, head_size=D, block_size=16,
                      rotary="half", seed=5))
    true_max = max(past) + 1
    results = {}
    for label, meta in (("absent", None), ("tight", [1, true_max]), ("loose", [1, 8 * true_max]),
                        ("undersized", [1, true_max // 8]), ("three_entries", [1, true_max, 1])):
        _, got = _run(case, meta)
        results[label] = got["output"].float().cpu()
        _check(case, got, f"metadata {label}")
    for label, out in results.items():
        err = rel_err(out, results["absent"])
        assert err <= 2e-3, f"metadata {label} vs absent: {err:.3g}"


def _graph_step_inputs(case, step: int, gen: torch.Generator) -> dict:
    """Step `step` of a growing decode: new Q/K/V tokens, past lengths grown by `step`."""
    x = dict(case.inputs)
    n = x["query"].shape[0]
    x["query"] = torch.randn(n, x["query"].shape[1], generator=gen).to(x["query"].dtype)
    x["key"] = torch.randn(n, x["key"].shape[1], generator=gen).to(x["key"].dtype)
    x["value"] = torch.randn(n, x["value"].shape[1], generator=gen).to(x["value"].dtype)
    x["past_seqlens"] = case.inputs["past_seqlens"] + step
    return x


@pytest.mark.parametrize("cache", ["same", "int8"])
def test_cuda_graph_of_8_decode_steps_equals_eager_bit_for_bit(cache):
    past = [5, 90, 600, 1500]
    kw = dict(k_quant="PER_TENSOR", v_quant="PER_TENSOR") if cache == "int8" else {}
    case = build(Spec(q_lens=[1] * 4, past=past, num_heads=H, kv_num_heads=HKV, head_size=D, block_size=16,
                      rotary="half", sink=True, extra_cols=2, cache=cache, seed=6, **kw))
    paged = _paged()
    outs = ["output", "key_cache_out", "value_cache_out"]
    steps = [_graph_step_inputs(case, s, torch.Generator().manual_seed(100 + s)) for s in range(8)]
    meta = torch.tensor([1, max(past) + 9], dtype=torch.int32)

    eager_x = _cuda(case.inputs)
    eager = []
    for feeds in steps:
        for k in ("query", "key", "value", "past_seqlens"):
            eager_x[k].copy_(feeds[k].cuda())
        got = paged.paged_attention(dict(eager_x, attention_metadata=meta), outputs=outs, validate=False,
                                    **case.attrs)
        eager.append((got["output"].clone(), eager_x["key_cache"].clone(), eager_x["value_cache"].clone()))

    static = _cuda(case.inputs)
    for k in ("query", "key", "value", "past_seqlens"):
        static[k].copy_(steps[0][k].cuda())
    warm = {k: v.clone() for k, v in static.items()}  # warm-up on copies: the caches stay untouched
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged.paged_attention(dict(warm, attention_metadata=meta), outputs=outs, validate=False, **case.attrs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = paged.paged_attention(dict(static, attention_metadata=meta), outputs=outs, validate=False,
                                         **case.attrs)
    for s, feeds in enumerate(steps):
        for k in ("query", "key", "value", "past_seqlens"):
            static[k].copy_(feeds[k].cuda())
        graph.replay()
        torch.cuda.synchronize()
        out, kc, vc = eager[s]
        assert torch.equal(captured["output"], out), f"step {s}: replayed output differs from eager"
        assert torch.equal(static["key_cache"].view(torch.uint8), kc.view(torch.uint8)), f"step {s}: key cache"
        assert torch.equal(static["value_cache"].view(torch.uint8), vc.view(torch.uint8)), f"step {s}: value cache"


def test_a_session_on_cuda_runs_triton_and_refuses_what_no_gpu_kernel_serves():
    from nodes import make_gqa_case, make_paged_case
    from pagedkit.runtime import InferenceSession

    paged_case = make_paged_case(num_heads=4, kv_num_heads=2, head_size=64, past=(10, 40), q_lens=(1, 1), seed=2)
    sess = InferenceSession(paged_case.model(), providers=["CUDAExecutionProvider"])
    assert set(sess.attention_variants.values()) == {"triton_paged"}
    gqa_model = make_gqa_case(seed=1).model()  # float32 GroupQueryAttention: triton_gqa serves float16 / bfloat16
    with pytest.raises(NotImplementedError, match="allow_reference_fallback"):
        InferenceSession(gqa_model, providers=["CUDAExecutionProvider"])
    with pytest.warns(UserWarning, match="loop-based reference"):
        InferenceSession(gqa_model, providers=["CUDAExecutionProvider"], allow_reference_fallback=True)


# --- fused MLA decode (variant triton_mla) at DeepSeek's shapes -------------------------------------------------
MLA = dict(num_heads=16, kv_num_heads=1, head_size=576, latent=True, v_head_size=512, rotary="half", rotary_dim=64,
           rotary_offset=512, attrs=dict(scale=0.07))
MLA_CACHES = [
    ("fp16", dict(cache="same")),
    ("bf16", dict(cache="same", dtype=torch.bfloat16)),
    ("fp8_tensor", dict(cache="float8e4m3fn", k_quant="PER_TENSOR")),
    ("int8_token", dict(cache="int8", k_quant="PER_TOKEN")),
]


def _mla():
    from pagedkit.kernels.triton import mla

    return mla


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("name,kw", MLA_CACHES, ids=[c[0] for c in MLA_CACHES])
def test_fused_mla_decode(name, kw, block_size):
    """triton_mla's entry (its cache write + the fused kernel) against the float64 oracle: contexts 1 .. 4096,
    16 and 128 heads (two head sub-groups), speculative drafts of 3 tokens."""
    for heads, q_lens in ((16, [1] * len(RAGGED)), (128, [1] * len(RAGGED)), (16, [3] * len(RAGGED))):
        spec = Spec(q_lens=q_lens, past=RAGGED, block_size=block_size, seed=block_size + heads,
                    **(MLA | {"num_heads": heads} | kw))
        case = build(spec)
        x = _cuda(case.inputs)
        got = _mla().paged_attention(x, outputs=["output", "key_cache_out"], validate=False, **case.attrs)
        torch.cuda.synchronize()
        _check(case, got, f"mla {name} block {block_size} heads {heads} q {q_lens[0]}")


def test_fused_mla_decode_captures_and_replays_exactly():
    """8 decode steps with a growing context, captured once as a CUDA graph (sync debug mode 'error' while
    capturing), replayed: the same outputs as eager, bit for bit."""
    spec = Spec(q_lens=[1] * 4, past=[100, 2000, 1, 700], block_size=64, seed=3, **MLA)
    case = build(spec)
    eager_x, graph_x = _cuda(clone_inputs(case.inputs)), _cuda(clone_inputs(case.inputs))
    graph_x["attention_metadata"] = torch.tensor([1, 2100, 0], dtype=torch.int32)
    eager_x["attention_metadata"] = graph_x["attention_metadata"]
    call = _mla().paged_attention
    call(clone_inputs(graph_x), outputs=["output"], validate=False, **case.attrs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = call(graph_x, outputs=["output"], validate=False, **case.attrs)["output"]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for step in range(8):
        for x in (eager_x, graph_x):
            x["past_seqlens"] += 1
            x["query"].normal_(generator=torch.Generator("cuda").manual_seed(step))
            x["key"].normal_(generator=torch.Generator("cuda").manual_seed(100 + step))
        graph.replay()
        want = call(eager_x, outputs=["output"], validate=False, **case.attrs)["output"]
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"step {step}: replay differs from eager"
