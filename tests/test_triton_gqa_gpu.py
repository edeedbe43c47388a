"""GroupQueryAttention on the Triton kernels (variant `triton_gqa`, pagedkit/kernels/triton/gqa.py) on the GPU at
real shapes (32 / 8 heads, head 128, float16 and bfloat16), against the independent float64 oracle
(tests/paged_oracle.py `gqa_oracle`: no pagedkit import), compared where the operator defines a value
(tests/test_gqa_oracle.py `compare_with_oracle`: outputs and output_qk norm-relative, max|diff| / max|ref| <=
5e-3 (float16) / 2e-2 (bfloat16); presents the same, quantized ones within one code):

- decode steps of a ragged batch (contexts 1 ... 4096, a first token included) on every cache triton_gqa
  serves: float, int8 / int4 / fp8 with PER_TENSOR, PER_CHANNEL and mixed scales; float16 steps on a shared
  past / present buffer (updated in place), bfloat16 ones on a growing cache;
- every feature GqaSpec expresses at real shapes (softcap, local windows, head sink, smooth_softmax,
  attention_bias, QK-norm, output_qk scores / probabilities, packed QKV, position_ids, partial and interleaved
  rotary, padded chunks through query_seqlens, causal=0, MQA / MHA, head sizes 80 / 256, quantized caches);
- prefills (512 / 1024 new tokens, padded batches, no past) and chunks of 256 tokens over a cached prefix of
  1000 (a chunked prefill);
- CUDA-graph capture of 8 decode steps with a growing context on a shared past / present buffer (float and
  int8 caches): the replays give the eager outputs and caches bit for bit, and every step matches the oracle;
- a one-node model in `pagedkit.InferenceSession` on CUDA dispatches to triton_gqa (also with
  capturable=True) and matches the oracle, a sliding_window_cache node too;
- teeth: a 2% wrong scale fails the bound.

The oracle is a float64 loop on the CPU (~1 us per key and head). Attention is separable per KV-head group, so
long prefills / chunks / feature cases check the oracle on some KV heads (`kv=`: the call restricted to those
heads and their query heads, the kernel's result sliced the same way); the kernel always runs the full call.
Run on the device: `pytest -m gpu tests/test_triton_gqa_gpu.py`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged_gqa import GqaSpec, make_gqa_inputs
from paged_oracle import gqa_oracle
from test_gqa_oracle import compare_with_oracle

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
H, HKV, D = 32, 8, 128
TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
RAGGED = (0, 1, 15, 255, 1000, 4095)  # tokens cached before a decode step (0: the sequence's first token)
PREFILL = 512  # new tokens of a prefill (also 2 * PREFILL)
PREFIX, CHUNK = 1000, 256  # a chunk of CHUNK tokens over PREFIX cached ones
GRAPH_PAST = (5, 90, 600, 1500)  # the CUDA-graph test's contexts before its 8 steps
GRAPH_CAPACITY = 1536  # its shared buffer: >= max(GRAPH_PAST) + 8 tokens
SESSION_PAST = (37, 300)
BF16 = torch.bfloat16


def _gqa():
    from pagedkit.kernels.triton import gqa

    return gqa


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _seed(name: str) -> int:
    return 90_000 + sum((i + 7) * ord(c) for i, c in enumerate(name)) % 10_000


def _to_device(inputs: dict) -> dict:
    # total_sequence_length is a host input (CPU-resident, like onnxruntime's)
    return {k: v if k == "total_sequence_length" else v.to(DEVICE) for k, v in inputs.items()}


def _run(inputs: dict, attrs: dict, **override) -> tuple[dict, dict, dict]:
    """(device inputs, device outputs, outputs on the CPU) of one triton_gqa call on copies of `inputs`."""
    dev = _to_device({k: v.clone() for k, v in inputs.items()})
    out = _gqa().group_query_attention(dev, validate=False, **(attrs | override))
    _sync()
    return dev, out, {k: v.cpu() for k, v in out.items()}


def _take(t: torch.Tensor, dim: int, idx: list) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:  # index through a byte view (fancy indexing of fp8 varies by version)
        return _take(t.view(torch.uint8), dim, idx).view(t.dtype)
    return t.index_select(dim, torch.tensor(idx, dtype=torch.long, device=t.device))


def _kv_slice(inputs: dict, attrs: dict, got: dict, kv) -> tuple[dict, dict, dict]:
    """The call restricted to KV heads `kv` and their query-head groups (attention, QK-norm, RoPE and the cache
    quantization are all per head), and the kernel's outputs `got` sliced the same way."""
    h, hkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    g = h // hkv
    kv = sorted({int(k) % hkv for k in kv})
    qh = [k * g + j for k in kv for j in range(g)]
    query = inputs["query"]
    b, s, w = query.shape
    packed = "key" not in inputs
    d = w // (h + 2 * hkv) if packed else w // h

    def heads(t, n, idx):  # [B, S, n * d] -> [B, S, len(idx) * d]
        return _take(t.reshape(b, s, n, d), 2, idx).reshape(b, s, len(idx) * d)

    x = dict(inputs)
    if packed:
        qq, kk, vv = query.split([h * d, hkv * d, hkv * d], dim=-1)
        x["query"] = torch.cat([heads(qq, h, qh), heads(kk, hkv, kv), heads(vv, hkv, kv)], dim=-1)
    else:
        x["query"] = heads(query, h, qh)
        x["key"], x["value"] = heads(inputs["key"], hkv, kv), heads(inputs["value"], hkv, kv)
    for name in ("past_key", "past_value"):
        if name in x:
            x[name] = _take(x[name], 1, kv)
    if "attention_bias" in x and x["attention_bias"].shape[1] > 1:
        x["attention_bias"] = _take(x["attention_bias"], 1, qh)
    if "head_sink" in x:
        x["head_sink"] = _take(x["head_sink"], 0, qh)
    for name in ("k_scale", "v_scale"):
        if name in x and x[name].numel() > 1:  # PER_CHANNEL [.., Hkv, .., D]
            x[name] = _take(x[name].reshape(1, hkv, 1, d), 1, kv)
    sliced = {}
    for name, t in got.items():
        if name == "output":
            sliced[name] = _take(t.reshape(b, s, h, d), 2, qh).reshape(b, s, len(qh) * d)
        elif name.startswith("present"):
            sliced[name] = _take(t, 1, kv)
        elif name == "output_qk":
            sliced[name] = _take(t, 1, qh)
        else:
            sliced[name] = t
    return x, {**attrs, "num_heads": len(qh), "kv_num_heads": len(kv)}, sliced


def _check(inputs: dict, attrs: dict, got: dict, dtype: torch.dtype, what: str, kv=None) -> dict:
    heads = "all heads"
    if kv is not None:
        hkv = int(attrs["kv_num_heads"])
        inputs, attrs, got = _kv_slice(inputs, attrs, got, kv)
        heads = f"KV heads {sorted({int(k) % hkv for k in kv})} of {hkv}"
    errs = compare_with_oracle(got, inputs, attrs, TOL[dtype])
    print(f"{what} ({heads}): {errs}")
    return errs


def _spec(kw: dict, dtype: torch.dtype | None = None) -> GqaSpec:
    base = dict(num_heads=H, kv_num_heads=HKV, head_size=D, dtype=torch.float16)
    return GqaSpec(**(base | kw | ({} if dtype is None else {"dtype": dtype})))


def _dtypes(cases):
    return [pytest.param(name, kw, dt, id=f"{name}-{str(dt).split('.')[-1]}") for name, kw in cases
            for dt in (torch.float16, BF16)]


# ---- 1. decode steps on every cache type ------------------------------------------------------------------

CACHES = [
    ("float", {}),
    ("int8_tensor", dict(cache="int8", k_quant="PER_TENSOR", v_quant="PER_TENSOR")),
    ("int8_channel", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
    ("int8_k_channel_v_tensor", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR")),
    # int4: a non-dyadic step (tests/test_triton_gqa.py LONG: keys on code ties with the default)
    ("int4_tensor", dict(cache="int4", k_quant="PER_TENSOR", v_quant="PER_TENSOR", quant_scale=0.37)),
    ("int4_channel", dict(cache="int4", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", quant_scale=0.37)),
    ("fp8_tensor", dict(cache="fp8", k_quant="PER_TENSOR", v_quant="PER_TENSOR")),
    ("fp8_channel", dict(cache="fp8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")),
    ("fp8_k_tensor_v_channel", dict(cache="fp8", k_quant="PER_TENSOR", v_quant="PER_CHANNEL")),
]


@pytest.mark.parametrize("name,kw,dtype", _dtypes(CACHES))
def test_decode_every_cache_type(name, kw, dtype):
    """One decode step of a ragged batch (contexts 1 .. 4096), RoPE on, every head checked. float16: a shared
    past / present buffer (capacity > total: the present IS the past, updated in place); bfloat16: a growing
    cache (capacity max(past): the present is a new tensor holding the past rows)."""
    shared = dtype == torch.float16
    capacity = max(RAGGED) + 1 + 63 if shared else None
    spec = _spec(dict(past=RAGGED, seq=1, rotary="half", capacity=capacity, **kw), dtype)
    inputs, attrs, _ = make_gqa_inputs(spec, _seed(name + str(dtype)))
    dev, out, got = _run(inputs, attrs)
    if shared:
        assert out["present_key"].data_ptr() == dev["past_key"].data_ptr()
        assert out["present_value"].data_ptr() == dev["past_value"].data_ptr()
    assert got["present_key"].shape[2] == (capacity or max(RAGGED) + 1)
    _check(inputs, attrs, got, dtype, f"decode {name} {dtype}")


# ---- 2. features ------------------------------------------------------------------------------------------

_CHUNK_Q = (8, 1, 5, 0, 8, 3)  # valid rows of a padded chunk (the entry of context 255 idle)
FEATURES = [  # (name, GqaSpec fields, T, KV heads the oracle checks)
    ("softcap_head_sink", dict(rotary="half", head_sink=True, attrs={"softcap": 2.0}), None, (0, 7)),
    ("local_window", dict(rotary="half", attrs={"local_window_size": 256}), None, (1, 6)),
    ("local_window_1", dict(attrs={"local_window_size": 1}), None, (2, 5)),
    ("smooth_softmax", dict(rotary="half", attrs={"smooth_softmax": 1}), BF16, (3, 4)),
    ("head_sink_and_smooth_softmax", dict(head_sink=True, attrs={"smooth_softmax": 1}), None, (0, 5)),
    ("bias_per_batch_head_softcap_scores", dict(bias=(len(RAGGED), H), attrs={"softcap": 2.0, "qk_output": 1}),
     None, (2, 7)),
    ("bias_broadcast_sink_probs", dict(bias=(1, 1), head_sink=True, attrs={"qk_output": 2}), None, (1, 4)),
    ("bias_per_head_bf16", dict(bias=(1, H), rotary="interleaved"), BF16, (0, 3)),
    ("qk_norm_separate_eps", dict(qk_norm=True, rotary="half", attrs={"q_norm_epsilon": 1e-3,
                                                                    "k_norm_epsilon": 1e-1}), None, (4, 6)),
    ("qk_norm_shared_eps_bf16", dict(qk_norm=True, rotary="half", attrs={"qk_norm_epsilon": 1e-2}), BF16, (1, 7)),
    ("rotary_interleaved_partial", dict(rotary="interleaved", rotary_dim=D // 2), None, (0, 6)),
    ("rotary_half_partial", dict(rotary="half", rotary_dim=D // 4), BF16, (2, 3)),
    ("position_ids", dict(rotary="half", position_ids=True), None, (5, 7)),
    ("custom_scale", dict(attrs={"scale": 0.05}), None, (0, 1)),
    ("packed_qkv_rotary", dict(packed=True, rotary="half"), None, (3, 7)),
    ("packed_qkv_chunk_bf16", dict(packed=True, seq=8, q=_CHUNK_Q, query_seqlens=True, rotary="interleaved",
                                   capacity=max(RAGGED) + 16), BF16, (0, 4)),
    ("padded_chunk_query_seqlens", dict(seq=8, q=_CHUNK_Q, query_seqlens=True, rotary="half",
                                        capacity=max(RAGGED) + 16), None, (1, 5)),
    ("padded_chunk_window_bias_probs", dict(seq=8, q=_CHUNK_Q, query_seqlens=True, bias=(len(RAGGED), 1),
                                            head_sink=True, capacity=max(RAGGED) + 16,
                                            attrs={"local_window_size": 64, "qk_output": 2}), None, (2, 6)),
    ("padded_chunk_position_ids", dict(seq=4, q=(4, 1, 2, 0, 4, 3), query_seqlens=True, rotary="half",
                                       position_ids=True), None, (0, 7)),
    ("speculative_rows", dict(seq=4, rotary="half", capacity=max(RAGGED) + 16), None, (3, 5)),
    ("bidirectional", dict(seq=4, attrs={"causal": 0, "qk_output": 1}), None, (1, 2)),
    ("mqa", dict(kv_num_heads=1, rotary="half"), None, (0,)),
    ("mha", dict(kv_num_heads=H, rotary="half", past=RAGGED[:-1]), None, (0, H - 1)),
    ("head_size_80", dict(head_size=80, rotary="half"), None, (0, 7)),
    ("head_size_256", dict(head_size=256, rotary="half", head_sink=True), BF16, (2, 5)),
    ("int8_window_sink", dict(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR", head_sink=True,
                              rotary="half", attrs={"local_window_size": 300}), None, (0, 7)),
    ("int4_softcap_bias_scores", dict(cache="int4", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL", quant_scale=0.37,
                                      bias=(1, H), attrs={"softcap": 2.0, "qk_output": 1}), None, (1, 6)),
    ("fp8_qk_norm_chunk", dict(cache="fp8", k_quant="PER_TENSOR", v_quant="PER_CHANNEL", qk_norm=True,
                               seq=8, q=_CHUNK_Q, query_seqlens=True, capacity=max(RAGGED) + 16,
                               attrs={"qk_norm_epsilon": 1e-3}), BF16, (3, 4)),
]


@pytest.mark.parametrize("name,kw,dtype,kv", [pytest.param(*f, id=f[0]) for f in FEATURES])
def test_features(name, kw, dtype, kv):
    """Each feature on the ragged batch (decode steps, or padded chunks of up to 8 rows), float16 unless said."""
    spec = _spec(dict(past=RAGGED, seq=1) | kw, dtype)
    inputs, attrs, _ = make_gqa_inputs(spec, _seed(name))
    _, _, got = _run(inputs, attrs)
    if attrs.get("qk_output"):
        assert "output_qk" in got
    _check(inputs, attrs, got, spec.dtype, f"feature {name}", kv=kv)


# ---- 3. prefills and chunks over a cached prefix ----------------------------------------------------------

PREFILLS = [  # (name, GqaSpec fields, KV heads the oracle checks)
    # plain causal first prompts (float caches, no softcap / window / sink / bias / output_qk): gqa.py's fused
    # attention route (gqa.LAST_ROUTE "cudnn" / "flash")
    ("fp16_padded_batch_no_past", dict(past=(0, 0, 0), seq=PREFILL, q=(PREFILL, 389, 77), has_past=False,
                                       rotary="half"), (0,)),
    # the same prompt described by query_seqlens, and the others: the split-KV kernel's query-chunk lanes
    ("fp16_padded_batch_query_seqlens", dict(past=(0, 0, 0), seq=PREFILL, q=(PREFILL, 389, 77), has_past=False,
                                             query_seqlens=True, rotary="half"), (4,)),
    ("bf16_padded_batch_shared_buffer", dict(past=(0, 0, 0), seq=PREFILL, q=(PREFILL, 300, 1),
                                             capacity=PREFILL + 64, rotary="interleaved", dtype=BF16), (7,)),
    ("fp16_1024_sink_softcap_window_qk_norm", dict(past=(0, 0), seq=2 * PREFILL, q=(2 * PREFILL, 700),
                                                   has_past=False, rotary="half", head_sink=True, qk_norm=True,
                                                   attrs={"softcap": 2.0, "local_window_size": 300}), (3,)),
    ("bf16_bidirectional", dict(past=(0,), seq=PREFILL, has_past=False, dtype=BF16, attrs={"causal": 0}), (5,)),
]


@pytest.mark.parametrize("name,kw,kv", [pytest.param(*p, id=p[0]) for p in PREFILLS])
def test_prefill(name, kw, kv):
    """First prompts of 512 / 1024 tokens (a padded batch: rows past each entry's length are NaN and must not be
    read; the present's first rows hold the prompt, rows past it unspecified), on both of gqa.py's routes."""
    spec = _spec(kw)
    inputs, attrs, _ = make_gqa_inputs(spec, _seed(name))
    _, _, got = _run(inputs, attrs)
    route = getattr(_gqa(), "LAST_ROUTE", None)
    _check(inputs, attrs, got, spec.dtype, f"prefill {name} (route {route})", kv=kv)


CHUNKS = [
    ("fp16_growing", dict(past=(PREFIX,), seq=CHUNK, rotary="half"), (2,)),
    ("bf16_padded_shared_buffer", dict(past=(PREFIX, 600), seq=CHUNK, q=(CHUNK, 131), query_seqlens=True,
                                       capacity=PREFIX + CHUNK + 32, rotary="half", dtype=BF16), (5,)),
    ("int8_channel_padded", dict(past=(PREFIX, 37), seq=CHUNK, q=(CHUNK, 64), query_seqlens=True,
                                 capacity=PREFIX + CHUNK, cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR",
                                 rotary="half"), (6,)),
    ("fp8_tensor_softcap_window", dict(past=(PREFIX,), seq=CHUNK, cache="fp8", k_quant="PER_TENSOR",
                                       v_quant="PER_TENSOR", attrs={"softcap": 2.0, "local_window_size": 500}), (1,)),
]


@pytest.mark.parametrize("name,kw,kv", [pytest.param(*c, id=c[0]) for c in CHUNKS])
def test_chunk_over_a_cached_prefix(name, kw, kv):
    """A chunked prefill: 256 new tokens over 1000 cached ones (with a second, shorter entry in the padded
    batches), on growing and shared buffers, float and quantized caches."""
    spec = _spec(kw)
    inputs, attrs, _ = make_gqa_inputs(spec, _seed(name))
    _, _, got = _run(inputs, attrs)
    _check(inputs, attrs, got, spec.dtype, f"chunk {name}", kv=kv)


# ---- 4. CUDA-graph capture --------------------------------------------------------------------------------

STEP_INPUTS = ("query", "key", "value", "seqlens_k")


def _graph_case(cache: str):
    """A decode batch on a shared past / present buffer of GRAPH_CAPACITY rows and 8 steps growing it: (base
    inputs with total_sequence_length = GRAPH_CAPACITY, attrs, per-step feeds {query, key, value, seqlens_k})."""
    kw = dict(cache="int8", k_quant="PER_TENSOR", v_quant="PER_CHANNEL") if cache == "int8" else {}
    spec = _spec(dict(past=GRAPH_PAST, seq=1, capacity=GRAPH_CAPACITY, rotary="half", head_sink=True, **kw))
    inputs, attrs, _ = make_gqa_inputs(spec, _seed("graph" + cache))
    # RoPE tables covering every step's positions (make_gqa_inputs sizes them for the first step)
    g = torch.Generator().manual_seed(_seed("graph rope"))
    angle = torch.rand((GRAPH_CAPACITY + 16, D // 2), generator=g, dtype=torch.float64) * 6.28
    inputs["cos_cache"], inputs["sin_cache"] = angle.cos().half(), angle.sin().half()
    # the captured call reads total on the host once (gqa.py sizes the present and the split launch from it):
    # a fixed bound for every step, the shared buffer's capacity; eager runs with the same value
    inputs["total_sequence_length"] = torch.tensor([GRAPH_CAPACITY], dtype=torch.int32)
    steps = []
    for s in range(8):
        gen = torch.Generator().manual_seed(_seed(f"graph step {s}"))
        feeds = {n: torch.randn(inputs[n].shape, generator=gen).half() for n in ("query", "key", "value")}
        feeds["seqlens_k"] = inputs["seqlens_k"] + s
        steps.append(feeds)
    assert int(steps[-1]["seqlens_k"].max()) + 1 <= GRAPH_CAPACITY
    return inputs, attrs, steps


def _eager_steps(inputs: dict, attrs: dict, steps: list) -> list:
    """The 8 steps called eagerly on persistent device buffers: [(output, present_key, present_value)] clones,
    each step checked against the oracle (past = the cache the previous step left; total = the true one)."""
    gqa = _gqa()
    x = _to_device({k: v.clone() for k, v in inputs.items()})
    results = []
    for s, feeds in enumerate(steps):
        before = {n: x[n].to("cpu", copy=True) for n in ("past_key", "past_value")}  # the past this step reads
        for n in STEP_INPUTS:
            x[n].copy_(feeds[n].to(DEVICE))
        got = gqa.group_query_attention(x, validate=False, **attrs)
        assert got["present_key"].data_ptr() == x["past_key"].data_ptr()  # in place: the shared buffer
        _sync()
        results.append((got["output"].clone(), x["past_key"].clone(), x["past_value"].clone()))
        ref_in = {**inputs, **feeds, **before,
                  "total_sequence_length": torch.tensor([int(feeds["seqlens_k"].max()) + 1], dtype=torch.int32)}
        cpu = {"output": got["output"].cpu(), "present_key": x["past_key"].cpu(),
               "present_value": x["past_value"].cpu()}
        _check(ref_in, attrs, cpu, torch.float16, f"eager step {s}", kv=(s, s + 3))
    return results


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # NaN rows (never written) compare equal as bytes


@pytest.mark.parametrize("cache", ["float", "int8"])
def test_cuda_graph_of_8_decode_steps_equals_eager_bit_for_bit(cache):
    """One call captured with torch.cuda.graph on persistent buffers (the step's q / k / v and seqlens_k copied
    in, past_key / past_value the shared buffer updated in place, total_sequence_length fixed to the capacity:
    a host value is baked into the graph), replayed 8 times with a growing context: the outputs and caches equal
    the eager calls' on an identical separate copy, bit for bit; host syncs are errors while capturing."""
    gqa = _gqa()
    inputs, attrs, steps = _graph_case(cache)
    eager = _eager_steps(inputs, attrs, steps)

    static = _to_device({k: v.clone() for k, v in inputs.items()})
    for n in STEP_INPUTS:
        static[n].copy_(steps[0][n].to(DEVICE))
    warm = {k: v.clone() for k, v in static.items()}  # warm-up (compiles) on copies: the caches stay untouched
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gqa.group_query_attention(warm, validate=False, **attrs)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")  # a host sync inside the call raises (and breaks the capture)
        try:
            captured = gqa.group_query_attention(static, validate=False, **attrs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert captured["present_key"].data_ptr() == static["past_key"].data_ptr()
    for s, feeds in enumerate(steps):
        for n in STEP_INPUTS:
            static[n].copy_(feeds[n].to(DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        out, kc, vc = eager[s]
        assert torch.equal(_bits(captured["output"]), _bits(out)), f"step {s}: replayed output differs from eager"
        assert torch.equal(_bits(static["past_key"]), _bits(kc)), f"step {s}: key cache differs from eager"
        assert torch.equal(_bits(static["past_value"]), _bits(vc)), f"step {s}: value cache differs from eager"


# ---- 5. a session -----------------------------------------------------------------------------------------

def _session_case():
    from nodes import make_gqa_case

    return make_gqa_case(batch=len(SESSION_PAST), seq=1, capacity=max(SESSION_PAST) + 64, past_lens=SESSION_PAST,
                         num_heads=H, kv_num_heads=HKV, head_size=D, dtype=torch.float16, rotary=True,
                         head_sink=True, seed=11)


def test_a_session_on_cuda_dispatches_gqa_to_triton_gqa():
    from nodes import gqa_case
    from pagedkit.runtime import InferenceSession

    case = _session_case()
    model = case.model()
    sess = InferenceSession(model, providers=["CUDAExecutionProvider"])
    assert set(sess.attention_variants.values()) == {"triton_gqa"}, sess.attention_dispatch
    names = [o.name for o in sess.get_outputs()]
    outs = sess.run(None, {n: t.numpy() for n, t in case.inputs.items()})
    assert set(sess.last_run_variants.values()) == {"triton_gqa"}
    got = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in zip(names, outs)}
    compare_with_oracle(got, case.inputs, case.attrs, TOL[torch.float16])
    # zero copy: the cache inputs are the shared buffer, updated in place
    feeds = _to_device({k: v.clone() for k, v in case.inputs.items()})
    res = sess.run_torch(feeds)
    assert res["present_key"].data_ptr() == feeds["past_key"].data_ptr()
    assert torch.equal(res["output"].cpu(), got["output"])  # same kernel, same inputs
    capt = InferenceSession(model, providers=["CUDAExecutionProvider"], capturable=True)
    assert set(capt.attention_variants.values()) == {"triton_gqa"}
    # a windowed cache (sliding_window_cache=1: gqa_window.py) runs on triton_gqa too
    wcase = gqa_case("sliding_window_cache", dtype=torch.float16)
    wsess = InferenceSession(wcase.model(), providers=["CUDAExecutionProvider"], allow_reference_fallback=False)
    assert set(wsess.attention_variants.values()) == {"triton_gqa"}, wsess.attention_dispatch
    wnames = [o.name for o in wsess.get_outputs()]
    wouts = wsess.run(None, {n: t.numpy() for n, t in wcase.inputs.items()})
    wgot = {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in zip(wnames, wouts)}
    compare_with_oracle(wgot, wcase.inputs, wcase.attrs, TOL[torch.float16])


# ---- teeth ------------------------------------------------------------------------------------------------

def test_teeth_a_2_percent_wrong_scale_fails_the_bound():
    """The decode case of float16 with the default scale 1 / sqrt(D) 2% off: the output error exceeds the bound
    (the right call passes it)."""
    spec = _spec(dict(past=RAGGED, seq=1, rotary="half"))
    inputs, attrs, _ = make_gqa_inputs(spec, _seed("teeth"))
    exp = gqa_oracle(inputs, attrs)["output"]
    defined = ~np.isnan(exp)
    tol = TOL[torch.float16]
    errs = {}
    for label, scale in (("right", 0.0), ("wrong", 1.02 / math.sqrt(D))):
        _, _, got = _run(inputs, attrs, scale=scale)
        have = got["output"].double().numpy()
        errs[label] = float(np.abs(have[defined] - exp[defined]).max() / np.abs(exp[defined]).max())
    print(f"teeth: scale x1.02 {errs['wrong']:.3g}, right {errs['right']:.3g} (bound {tol})")
    assert errs["right"] <= tol
    assert errs["wrong"] > tol, f"a 2% wrong scale passes the bound: {errs['wrong']:.3g} <= {tol}"
