"""paged-export, Llama 4 text (llama4_text): chunked attention on the RoPE layers (attention_bias from the token
positions, chunk 8: prompts of 11 and 37 tokens and the decode steps cross chunk edges), NoPE layers with the
query temperature, the weightless QK-norm after RoPE fused into the node, interleaved llama3 RoPE, dense and MoE
layers (top-1, sigmoid on the expert input, shared expert) (tests/family_harness.py: fp32 / fp16 parity,
decomposed in onnxruntime, teeth)."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

from export_utils import attention_attrs, check_parity
from family_harness import (FP32_BOUNDARY_TOL, FamilyCase, check_builtin, check_decomposed, check_export, check_teeth,
                            export_case, fp16_node_boundary, model_of, torch_session, _r16)

LLAMA4 = dict(num_hidden_layers=4, intermediate_size_mlp=80, num_local_experts=4, num_experts_per_tok=1,
              no_rope_layers=[1, 0, 1, 0], moe_layers=[1, 2], attention_chunk_size=8, floor_scale=4, attn_scale=0.3,
              attention_bias=True, rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=16.0,
                                                        low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_position_embeddings=32))
# boundary=False: the harness's emulation rounds Q / K before HF's RoPE and then normalizes after it, but the node
# normalizes first (the fused QK-norm), and with T-rounded cos / sin RoPE is not an exact rotation, so the two
# orders differ at that rounding; test_llama4_fp32_boundary runs the 1e-3 check with the node's order emulated.
CASE = FamilyCase("Llama4TextConfig", LLAMA4, seed=5, boundary=False)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_llama4_parity(tmp_path, dtype):
    print("llama4", check_export(CASE, tmp_path, dtype))


@contextlib.contextmanager
def norm_before_rope(hf, rope):
    """Inside fp16_node_boundary: what the node computes on RoPE layers, rope(norm(Q_T)) with T-rounded cos / sin
    (`rope`: HF's own apply_rotary_emb), in place of HF's norm(rope(Q)) (the qk_norm modules pass through)."""
    mod = importlib.import_module(type(hf).__module__)
    saved, norm = mod.apply_rotary_emb, mod.Llama4TextWeightlessRMSNorm(hf.config.rms_norm_eps)
    mod.apply_rotary_emb = lambda q, k, f: rope(norm(_r16(q)), norm(_r16(k)), torch.complex(_r16(f.real), _r16(f.imag)))
    hooks = [m.register_forward_hook(lambda m, args, out: args[0]) for n, m in hf.named_modules()
             if n.endswith("qk_norm")]
    try:
        yield
    finally:
        mod.apply_rotary_emb = saved
        for h in hooks:
            h.remove()


def test_llama4_fp32_boundary(tmp_path):
    hf, _ = model_of(CASE)
    out = export_case(CASE, tmp_path / "fp32", "fp32")
    rope = importlib.import_module(type(hf).__module__).apply_rotary_emb
    with fp16_node_boundary(hf, out), norm_before_rope(hf, rope):
        worst = check_parity(hf, out, prompt_lens=CASE.prompt_lens, steps=CASE.steps, tol=FP32_BOUNDARY_TOL,
                             session=torch_session(out)).worst_ratio
    print("llama4 fp32_boundary", worst)


def test_llama4_decomposed(tmp_path):
    print("llama4 decomposed", check_decomposed(CASE, tmp_path))


def test_llama4_graph(tmp_path):
    """Per layer: RoPE (interleaved) with all-ones QK-norm on RoPE layers, none on NoPE layers; the chunk bias on
    the chunked layers (context 256 > chunk 8), one MoE node per MoE layer; no bias once the context fits one
    chunk (and HF parity there); the default context capped at 8192; the weightless norm commutes with RoPE."""
    import onnx

    hf, memo = model_of(CASE)
    out = export_case(CASE, tmp_path / "a", "fp16")
    attrs = attention_attrs(out / "model.onnx")
    assert [a.get("do_rotary", 0) for a in attrs] == [1, 0, 1, 0]
    assert [a.get("rotary_interleaved", 0) for a in attrs] == [1, 0, 1, 0]
    assert ["q_norm_weight" in a["inputs"] for a in attrs] == [True, False, True, False]
    assert ["attention_bias" in a["inputs"] for a in attrs] == [True, False, True, False]
    m = onnx.load(str(out / "model.onnx"))
    assert sum(n.op_type == "MoE" for n in m.graph.node) == 2
    ones = next(i for i in m.graph.initializer if i.name == "model.layers.0.attn.q_norm.weight")
    assert (onnx.numpy_helper.to_array(ones) == 1).all()
    short = export_case(CASE, tmp_path / "b", "fp16", max_seq_len=8)  # context 8 <= chunk 8: plain causal
    assert not any("attention_bias" in a["inputs"] for a in attention_attrs(short / "model.onnx"))
    rep = check_parity(hf, short, prompt_lens=(3, 5), steps=3, reference=memo, session=torch_session(short))
    print("llama4 context within one chunk", rep.worst_ratio)

    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.families.llama4 import Llama4Family
    saved, hf.config.max_position_embeddings = hf.config.max_position_embeddings, 10485760
    try:
        assert Llama4Family().model_spec(hf, ExportOptions()).context_length == 8192
    finally:
        hf.config.max_position_embeddings = saved
    mod = importlib.import_module(type(hf).__module__)
    q, k = torch.randn(2, 5, 4, 16, dtype=torch.float64).unbind(0)
    cis = torch.polar(torch.ones(1, 5, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64))
    norm = mod.Llama4TextWeightlessRMSNorm(1e-5)
    after = [norm(t) for t in mod.apply_rotary_emb(q, k, cis)]
    before = mod.apply_rotary_emb(norm(q), norm(k), cis)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(after, before))


def test_llama4_chunked_prefill_query_positions(tmp_path):
    """Prefill in pieces of 5 tokens (bias rows with past > 0 and several queries, sequences of unequal lengths),
    positions from the query_positions input (the chunk bias and the temperature read them)."""
    hf, memo = model_of(CASE)
    out = export_case(CASE, tmp_path, "fp16", query_positions=True)
    rep = check_parity(hf, out, prompt_lens=CASE.prompt_lens, steps=CASE.steps, chunk=5, reference=memo,
                       session=torch_session(out))
    print("llama4 chunked prefill, query_positions", rep.worst_ratio)


def test_llama4_multimodal_checkpoint_folder(tmp_path):
    """A `llama4` (Llama4ForConditionalGeneration) checkpoint folder exports its text model: the loader's
    AutoModelForCausalLM builds Llama4ForCausalLM from text_config and the language model's weights
    (--num-layers cuts text_config); an in-memory multimodal model is refused (test_llama4_refusals)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from export_utils import TINY
    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.weights import load_model

    text = TINY | dict(intermediate_size_mlp=80, num_hidden_layers=2, num_local_experts=4, no_rope_layers=[1, 0])
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                  patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(0)
    mm = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)).eval()
    mm.save_pretrained(tmp_path / "ckpt")
    export(tmp_path / "ckpt", tmp_path / "out", ExportOptions(progress=False), num_layers=1)
    hf = load_model(tmp_path / "ckpt", num_layers=1).model
    assert type(hf).__name__ == "Llama4ForCausalLM" and hf.config.num_hidden_layers == 1
    assert torch.equal(hf.model.layers[0].self_attn.q_proj.weight,
                       mm.language_model.model.layers[0].self_attn.q_proj.weight)
    check_parity(hf, tmp_path / "out", prompt_lens=(11, 20), steps=3, session=torch_session(tmp_path / "out"))


def test_llama4_chunk_bias_triton_interpreter():
    """The Triton PagedAttention variant (Triton's interpreter on the CPU) on a Llama 4 chunked node — packed QKV,
    interleaved RoPE, all-ones QK-norm, the chunk bias (chunk 8: whole split-KV tiles at MASK) — equals the
    reference kernel; the bias dropped does not."""
    pytest.importorskip("triton")
    from pagedkit.exporters.families.llama4 import MASK
    from pagedkit.kernels.paged.reference import paged_attention as reference
    from pagedkit.kernels.triton.paged import paged_attention as triton_paged

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, d, chunk = 4, 2, 16, 8
    past, new = [9, 30], [5, 1]  # a chunked-prefill piece across a chunk edge, and a decode token
    pos = torch.tensor([p + j for p, n in zip(past, new) for j in range(n)])
    bias = torch.full((2, 1, max(new), max(p + n for p, n in zip(past, new))), MASK)
    for b, (p, n) in enumerate(zip(past, new)):
        for j in range(n):
            bias[b, 0, j, (p + j) // chunk * chunk:] = 0.0
    angles = torch.arange(64.0)[:, None] * 0.7 ** torch.arange(d // 2.0)[None]
    x = dict(query=torch.randn(len(pos), (heads + 2 * kv_heads) * d, generator=gen),
             key_cache=torch.randn(8, 16, kv_heads, d, generator=gen),
             value_cache=torch.randn(8, 16, kv_heads, d, generator=gen),
             cumulative_sequence_length=torch.tensor([0, 5, 6], dtype=torch.int32),
             past_seqlens=torch.tensor(past, dtype=torch.int32),
             block_table=torch.tensor([[3, -1], [0, 7]], dtype=torch.int32),
             cos_cache=angles.cos(), sin_cache=angles.sin(), q_norm_weight=torch.ones(d), k_norm_weight=torch.ones(d),
             attention_bias=bias, attention_metadata=torch.tensor([5, 31, 0], dtype=torch.int32))
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=1, qk_norm_epsilon=1e-5)

    def run(fn, drop=()):
        feeds = {k: v if k == "attention_metadata" else v.half() if v.is_floating_point() else v.clone()
                 for k, v in x.items() if k not in drop}
        return fn(feeds, outputs=["output"], **attrs)["output"].float()

    want, got = run(reference), run(triton_paged)
    assert (got - want).abs().max() <= 2e-3 * want.abs().max()
    assert (run(triton_paged, drop=("attention_bias",)) - want).abs().max() > 0.1 * want.abs().max()


def test_llama4_refusals():
    from pagedkit.exporters.families.llama4 import Llama4Family

    hf, _ = model_of(CASE)
    with pytest.raises(NotImplementedError, match="num_experts_per_tok 2"):
        Llama4Family().check(type(hf.config)(**(LLAMA4 | dict(num_experts_per_tok=2))))
    from transformers import Llama4Config
    with pytest.raises(NotImplementedError, match="model_type 'llama4'"):
        Llama4Family().check(Llama4Config())


# ---- teeth: each family feature removed must fail the parity check ---------------------------------------

def _family():
    from pagedkit.exporters.families import llama4
    return llama4


def test_llama4_chunk_mask_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(_family().Llama4Family, "attention_bias", lambda self, ctx, i: None))


def test_llama4_nope_rule_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(_family().Llama4Family, "rope_key", lambda self, config, i: "cos_cache"))


def test_llama4_temperature_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(_family().Llama4Family, "temperature", lambda self, ctx, i, q: q))


def test_llama4_qk_norm_has_teeth(tmp_path, monkeypatch):
    check_teeth(CASE, tmp_path, monkeypatch,
                lambda m: m.setattr(_family().Llama4Family, "qk_norm", lambda self, attn: None))


def test_llama4_input_side_router_weight_has_teeth(tmp_path, monkeypatch):
    """The router's sigmoid weight on the expert OUTPUT (routed_moe) instead of its input."""
    from pagedkit.exporters.moe import routed_moe

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(
        _family(), "input_scaled_moe", lambda g, x, idx, w, ex, p, ip: routed_moe(g, x, idx, w, ex, p, ip)))


def test_llama4_shared_expert_has_teeth(tmp_path, monkeypatch):
    from pagedkit.exporters.graph import scale

    check_teeth(CASE, tmp_path, monkeypatch, lambda m: m.setattr(
        _family(), "shared_expert", lambda g, x, mlp, act, layer: scale(g, x, 0.0, f"/model/layers.{layer}/no_shared")))


def test_llama4_builtin_spec():
    """The built-in Scout text config at 4 layers (weights on the meta device: no memory): default context 8192
    (= attention_chunk_size, so no chunk bias), RoPE / NoPE pattern 1, 1, 1, 0 with the QK-norm on RoPE layers,
    every layer MoE, interleaved rotary tables [8192, 64] of its llama3 scaling (factor 16)."""
    from transformers import AutoModelForCausalLM

    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.families.llama4 import Llama4Family
    from pagedkit.exporters.weights import _config_from_dict, builtin_config, shrink_config

    config = shrink_config(_config_from_dict(builtin_config("llama-4-scout-17b-16e-instruct"), "scout"), 4, 2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    family = Llama4Family()
    spec = family.model_spec(model, ExportOptions())
    assert spec.context_length == 8192 == config.attention_chunk_size
    assert [l.rope for l in spec.layers] == ["cos_cache"] * 3 + [None]
    assert [family.qk_norm(layer.self_attn) is not None for layer in model.model.layers] == [True] * 3 + [False]
    assert all(hasattr(layer.feed_forward, "router") for layer in model.model.layers)
    cos, sin = family.rope_tables(model, spec.context_length)["cos_cache"]
    assert cos.shape == sin.shape == (8192, 64)
    inv = type(model.model.rotary_emb)(config=config).inv_freq
    assert torch.allclose(sin[1], torch.sin(inv), atol=1e-6) and inv[-1] < 500000.0 ** -(126 / 128) / 15


@pytest.mark.slow
def test_llama4_builtin(tmp_path):
    """Scout has no smaller real sibling: at 4 layers and 1 routed expert it is 3.33e9 parameters (its 202048 x 5120
    embedding and LM head are 2.07e9): 12.4 GiB in float32 for the HF reference; the export streams its weights
    to model.onnx.data as they are evaluated and drops the HF model before the session runs (measured: worst
    0.0029, peak 19.7 GB, 2.5 min)."""
    print("llama-4-scout", check_builtin("llama-4-scout-17b-16e-instruct", tmp_path, num_layers=4, num_experts=1,
                                         max_seq_len=64))
