"""The Triton PagedAttention variant (`triton_paged`: cache-write launch + split-KV attention) on every
PagedAttention case file, through Triton's interpreter on the CPU (TRITON_INTERPRET=1, tests/conftest.py)
or compiled on CUDA: outputs and caches equal the cases' expected ones (the reference's, checked against
the float64 oracle by tests/test_reference_paged.py), caches updated in place, the custom ops pass
torch.library.opcheck, and a removed feature fails the comparison (teeth)."""

from __future__ import annotations

import pytest
import torch

from cases import compare_case, load_cases, load_index

triton = pytest.importorskip("triton")  # under CI a failure (conftest.py)

from pagedkit.kernels.triton import paged  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGED = [e["name"] for e in load_index() if e["op"] == "PagedAttention"]


def _run(case, inputs=None, **override):
    # attention_metadata is a host input (CPU-resident, like onnxruntime's)
    inputs = {k: v if k == "attention_metadata" else v.to(DEVICE) for k, v in (inputs or case.inputs).items()}
    got = paged.paged_attention(inputs, outputs=list(case.expected), validate=False, **(case.attrs | override))
    return inputs, got


@pytest.mark.parametrize("name", PAGED)
def test_case_file(name):
    case = load_cases([name])[0]
    inputs, got = _run(case)
    compare_case(case, {k: v.cpu() for k, v in got.items()})
    for out_name, in_name in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache"),
                              ("k_scale_cache_out", "k_scale_cache"), ("v_scale_cache_out", "v_scale_cache")):
        if out_name in got:
            assert got[out_name].data_ptr() == inputs[in_name].data_ptr(), f"{out_name} is not {in_name} (in place)"


@pytest.mark.parametrize("name,override", [
    ("paged_sink_window_softcap", {"softcap": 2.04}),  # a 2% wrong softcap
    ("paged_sink_window_softcap", {"local_window_size": 0}),  # the window removed
    ("paged_metadata_custom_scale", {"scale": 0.204}),  # a 2% wrong scale
    ("paged_qk_norm", {"qk_norm_epsilon": 1.0}),  # QK-norm's epsilon ignored
    ("paged_bidirectional_window", {"is_causal": 1}),
    ("paged_partial_rotary", {"rotary_interleaved": 1}),
])
def test_teeth_a_wrong_attribute_fails(name, override):
    case = load_cases([name])[0]
    _, got = _run(case, **override)
    with pytest.raises(AssertionError):
        compare_case(case, {k: v.cpu() for k, v in got.items()})


def test_teeth_dropping_head_sink_fails():
    case = load_cases(["paged_bias_probs_sink"])[0]
    inputs = {k: v for k, v in case.inputs.items() if k != "head_sink"}
    _, got = _run(case, inputs)
    with pytest.raises(AssertionError):
        compare_case(case, {k: v.cpu() for k, v in got.items()})


def test_bad_attention_metadata_is_named():
    case = load_cases(["paged_metadata_custom_scale"])[0]
    inputs = dict(case.inputs, attention_metadata=torch.tensor([1, -3], dtype=torch.int32))
    with pytest.raises(ValueError, match="attention_metadata"):
        _run(case, inputs)


def _op_args(case):
    """The two custom ops' arguments for a case (as the variant entry builds them)."""
    from pagedkit.kernels.triton import common, ops  # noqa: F401

    x = {k: v.to(DEVICE) for k, v in case.inputs.items()}
    a = paged._DEFAULTS | case.attrs
    nh, hkv = int(a["num_heads"]), int(a["kv_num_heads"])
    d = x["key"].shape[1] // hkv
    kf = common.side_format(x["key_cache"], a["k_cache_dtype"], a["k_quant_type"], "key_cache")
    vf = common.side_format(x["value_cache"], a["v_cache_dtype"], a["v_quant_type"], "value_cache")
    tensors = (x["query"], x["key"], x["value"], x["cumulative_sequence_length"], x["past_seqlens"],
               x["block_table"], x["key_cache"], x["value_cache"], None, None, x.get("cos_cache"),
               x.get("sin_cache"), None, None, None, None, None, None)
    kw = dict(num_heads=nh, kv_num_heads=hkv, head_size=d, k_fmt=kf.fmt, k_scale_mode=kf.scale, v_fmt=vf.fmt,
              v_scale_mode=vf.scale, rotary=bool(a["do_rotary"]), rotary_interleaved=False, rotary_offset=0,
              qk_norm_epsilon=1e-6, qk_rotation=False, v_rotation=False, latent=False)
    return x, tensors, kw, (kf, vf, nh, hkv, d)


def test_custom_ops_pass_opcheck():
    case = load_cases(["paged_llama_fp16_rotary"])[0]
    x, tensors, kw, (kf, vf, nh, hkv, d) = _op_args(case)
    torch.library.opcheck(torch.ops.pagedkit.write_kv.default, tensors, kw,
                          test_utils=("test_schema", "test_faketensor"))
    q = torch.ops.pagedkit.write_kv(*tensors, **kw)
    dec_args = (q, x["key_cache"], x["value_cache"], x["cumulative_sequence_length"], x["past_seqlens"],
                x["block_table"], None, None, None, None, None, None, None)
    dec_kw = dict(k_fmt=kf.fmt, k_scale_mode=kf.scale, v_fmt=vf.fmt, v_scale_mode=vf.scale, num_heads=nh,
                  kv_num_heads=hkv, head_size=d, v_head_size=d, scale=d ** -0.5, softcap=0.0,
                  local_window_size=0, is_causal=True, qk_output=0, v_rotation=False, max_query_len=0,
                  max_kv_len=0)
    torch.library.opcheck(torch.ops.pagedkit.paged_decode.default, dec_args, dec_kw,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_fake_shapes_follow_the_contract():
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = load_cases(["paged_bias_scores"])[0]
    with FakeTensorMode(allow_non_fake_inputs=True):
        _, got = _run(case)
        assert tuple(got["output"].shape) == tuple(case.expected["output"].shape)
        assert tuple(got["output_qk"].shape) == tuple(case.expected["output_qk"].shape)
        assert got["output_qk"].dtype == torch.float32


def test_head_size_limits_both_sides():
    """triton_paged serves Q/K heads up to 256 (LATENT: 576) and refuses the next size, naming it and the limit."""
    from types import SimpleNamespace

    def info(head_size, layout="SEPARATE"):
        return SimpleNamespace(head_size=head_size, layout=layout)

    assert paged._supports(info(256)) is None and paged._supports(info(None)) is None
    assert paged._supports(info(257)) == "head_size 257 > 256"
    assert paged._supports(info(576, "LATENT")) is None
    assert paged._supports(info(577, "LATENT")) == "head_size 577 > 576"


@pytest.mark.parametrize("h,hkv", [(4, 1), (4, 4), (6, 3)])
def test_packed_qkv_with_other_kv_head_counts(h, hkv):
    """Packed QKV [N, (H + 2 Hkv) D]: the head size is derived from the width (the case files pack 4 / 2 heads only);
    output and caches against the loop reference on a copy of the inputs."""
    from test_paged_vs_gqa import make_paged

    from pagedkit.kernels.paged import reference

    x, a = make_paged(num_heads=h, kv_num_heads=hkv, packed=True, rotary="half", seed=40 + h + hkv)
    names = ["output", "key_cache_out", "value_cache_out"]
    ref = reference.paged_attention({k: v.clone() for k, v in x.items()}, outputs=names, **a)
    got = paged.paged_attention({k: v if k == "attention_metadata" else v.clone().to(DEVICE) for k, v in x.items()},
                                outputs=names, validate=False, **a)
    for n in names:
        r, g = ref[n].float(), got[n].float().cpu()
        nan = r.isnan()  # unwritten cache slots keep the case's NaN poison
        assert g.shape == r.shape and torch.equal(g.isnan(), nan), n
        assert float((g - r)[~nan].abs().max()) <= 2e-3 * float(r[~nan].abs().max()), n
