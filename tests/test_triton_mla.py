"""The fused MLA (LATENT) attention (pagedkit/kernels/triton/mla.py, variant triton_mla) vs the loop-based
reference, in Triton's interpreter on CPU (on CUDA the same tests run compiled; the H200 shapes are in
test_triton_gpu.py).

Each case: random Q / latent K and a shuffled, garbage-filled latent cache (tests/paged_oracle.build); the reference
prologue (`prepare`, on a copy) writes the step's tokens and the kernel runs on its Step; the reference output comes
from `reference.paged_attention` on another copy. Bound: max|diff| <= tol * max|ref| (fp16 5e-3, bf16 2e-2).
Outputs and workspaces are poisoned with NaN. Teeth: a 2% wrong scale, a dropped rope part and an ignored window
fail the same bound. Dispatch: the variant serves LATENT decode plans and refuses what it lacks, naming it.
"""

from __future__ import annotations

import pytest
import torch

from paged_oracle import Spec, build, clone_inputs
from pagedkit.kernels.attention_math import default_scale
from pagedkit.kernels.paged.prologue import prepare
from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.kernels.triton import common

pytest.importorskip("triton")  # under CI a failure (conftest.py)
from pagedkit.kernels.triton import decode, mla  # noqa: E402

TOL = {torch.float16: 5e-3, torch.bfloat16: 2e-2}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(decode, "_POISON", True)


def spec(**kw) -> Spec:
    """A LATENT node: 4 heads, latent 32 + rope 16 channels (head_size 48), scale 0.1."""
    kw.setdefault("q_lens", [1, 1, 1, 1])
    kw.setdefault("past", [40, 0, 7, 100])
    kw.setdefault("num_heads", 4)
    kw.setdefault("head_size", 48)
    kw.setdefault("v_head_size", 32)
    attrs = {"scale": 0.1} | kw.pop("attrs", {})
    return Spec(kv_num_heads=1, latent=True, attrs=attrs, **kw)


def run_mla(st, **over) -> torch.Tensor:
    x, a = st.x, st.attrs
    kf = common.side_format(st.kside.cache, str(a["k_cache_dtype"]), str(a["k_quant_type"]), "key_cache")
    kw = dict(key_cache=st.kside.cache, k_format=kf, cumulative_sequence_length=x["cumulative_sequence_length"],
              past_seqlens=x["past_seqlens"], block_table=x["block_table"], num_heads=st.num_heads,
              head_size=st.head_size, v_head_size=st.v_head, scale=default_scale(float(a["scale"]), st.head_size),
              k_scale=common.static_scale_vector(x.get("k_scale"), 1, st.head_size),
              k_scale_cache=x.get("k_scale_cache"), query_positions=x.get("query_positions"),
              local_window_size=int(a["local_window_size"]), is_causal=bool(int(a["is_causal"])))
    kw.update(over)
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return mla.mla_decode(st.q.to(st.t_dtype).to(DEVICE), **kw).cpu()


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), "non-finite output"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def error(s: Spec, **over) -> float:
    case = build(s)
    ref = paged_attention(clone_inputs(case.inputs), **case.attrs)["output"]
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    out = run_mla(st, **over)
    assert out.dtype == s.dtype and out.shape == ref.shape
    return rel(out, ref)


def check(s: Spec, **over) -> None:
    err = error(s, **over)
    assert err <= TOL[s.dtype], f"output max|diff| / max|ref| = {err:.3g} > {TOL[s.dtype]}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode(dtype, splits):
    """One token per sequence (contexts 1 .. 101), split-KV with the reduce and without (the direct write)."""
    check(spec(dtype=dtype), num_splits=splits)


def test_auto_splits_and_16_heads():
    """DeepSeek-like head count (16: one program holds every head), the launcher's own split choice."""
    check(spec(num_heads=16, past=[130, 3, 64, 0]))


@pytest.mark.parametrize("heads", [2, 96])
def test_head_groups(heads):
    """Fewer heads than the 16-row minimum (rows padded) and more than one program's 64 (two sub-groups)."""
    check(spec(num_heads=heads, q_lens=[1, 1], past=[20, 45]), num_splits=2)


@pytest.mark.parametrize("q_lens,past", [([3, 0, 2, 1], [10, 4, 0, 20]),  # speculative drafts, an idle sequence
                                         ([12, 5], [0, 30])])  # a small prefill and a chunk over a prefix
def test_several_query_tokens(q_lens, past):
    """Rows = query tokens x heads per chunk (4 heads: up to 4 tokens a chunk), causal within the step."""
    check(spec(q_lens=q_lens, past=past), num_splits=2, max_query_len=max(q_lens))


@pytest.mark.parametrize("cache,quant", [("int8", "PER_TENSOR"), ("int8", "PER_TOKEN"),
                                         ("float8e4m3fn", "PER_TENSOR"), ("float8e4m3fn", "PER_TOKEN")])
@pytest.mark.parametrize("splits", [1, 2])
def test_quantized_latent_caches(cache, quant, splits):
    """The one K scale serves V too: PER_TENSOR on the scores and the output (kernel or reduce), PER_TOKEN per key."""
    check(spec(cache=cache, k_quant=quant, past=[40, 4, 0, 20]), num_splits=splits)


def test_window_positions_blocks_and_bigger_channels():
    """A sliding window, explicit query_positions, 32-token blocks with 16-key tiles, latent 64 + rope 16,
    an unmapped past block."""
    check(spec(head_size=80, v_head_size=64, block_size=32, past=[70, 5, 33, 90], query_positions=[50, 5, 30, 89],
               unmapped=((0, 0),), attrs={"local_window_size": 20}), num_splits=2, block_n=16)


def test_non_causal_step():
    check(spec(q_lens=[3, 2], past=[9, 17], attrs={"is_causal": 0}), num_splits=2)


def test_teeth():
    """The comparison catches a 2% wrong scale, a dropped rope part and an ignored window."""
    s = spec(past=[60, 4, 31, 80], attrs={"local_window_size": 16})
    tol = TOL[s.dtype]
    case = build(s)
    ref = paged_attention(clone_inputs(case.inputs), **case.attrs)["output"]
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    assert rel(run_mla(st, scale=0.1 * 1.02), ref) > tol
    assert rel(run_mla(st, local_window_size=0), ref) > tol
    no_rope = st.q.clone()
    no_rope[..., 32:] = 0  # the rope product removed
    st.q = no_rope
    assert rel(run_mla(st), ref) > tol
    assert error(s) <= tol  # and the right call passes


def test_dispatch_serves_latent_decode_and_refuses_the_rest():
    from pagedkit.kernels.dispatch import NodeInfo

    def info(**kw):
        base = dict(op_type="PagedAttention", attrs={"kv_cache_layout": "LATENT"}, present_inputs={"key"},
                    present_outputs=set(), device=torch.device("cuda"), t_dtype="float16", num_heads=16,
                    kv_num_heads=1, head_size=576, v_head_size=512, layout="LATENT", k_cache_format="float16")
        return NodeInfo(**(base | kw))

    v = mla.VARIANT
    assert v.refusal(info()) is None and v.plans == ("decode",) and v.capturable
    assert v.serves_plan("decode") and not v.serves_plan(None) and not v.serves_plan("prefill")
    assert "LATENT only" in v.refusal(info(layout="SEPARATE", attrs={}))
    assert "power of two" in v.refusal(info(head_size=560))
    assert "int4" in v.refusal(info(k_cache_format="int4"))
    assert "PER_CHANNEL" in v.refusal(info(k_cache_format="int8", attrs={"kv_cache_layout": "LATENT",
                                                                          "k_quant_type": "PER_CHANNEL"}))
    assert "softcap" in v.refusal(info(attrs={"kv_cache_layout": "LATENT", "softcap": 30.0}))
    assert "bfloat16" in v.refusal(info(k_cache_format="bfloat16"))
    # the (latent, rope) limit (512, 128), both sides of each bound
    assert v.refusal(info(head_size=48, v_head_size=32)) is None
    assert v.refusal(info(head_size=640, v_head_size=512)) is None
    assert v.refusal(info(head_size=192, v_head_size=128)) is None
    assert "beyond (512, 128)" in v.refusal(info(head_size=1024 + 64, v_head_size=1024))
    assert "beyond (512, 128)" in v.refusal(info(head_size=512 + 256, v_head_size=512))
    case = build(spec())
    st = prepare(clone_inputs(case.inputs), case.attrs, None)
    with pytest.raises(ValueError, match=r"query should be \[N, 4 \* 64\]"):
        run_mla(st, head_size=64, v_head_size=32)
    with pytest.raises(ValueError, match=r"query should be \[N, 4 \* 32\]"):  # a wider query than H * D
        run_mla(st, head_size=32, v_head_size=16)
    with pytest.raises(ValueError, match=r"key_cache should be \[NB, BS, 1, 48\]"):
        run_mla(st, key_cache=st.kside.cache[..., :40])
