"""paged-export --dtype fp32: float32 weights and activations everywhere except inside each PagedAttention
node, whose T is float16 / bfloat16 only (contract-decisions §6): Casts to float16 in front of the node
(packed QKV / query, key, value), float16 initializers for its T-typed constants (cos/sin, head_sink,
q/k norm weights), a Cast back to float32 after it, float16 caches, float32 logits.

Measured on the tiny random models below (tests/export_utils.py; two sequences, prefill + 16 teacher-forced
decode steps, worst step of max|diff| / max|ref|; fp16 caches; blank: not measured here):

    family        fp32 export   fp16 export   fp32, scale x1.02   fp32 vs HF with node-boundary fp16
    Llama         3.5e-3        3.8e-3        4.8e-2              7.9e-5   (the fp16 export: 3.5e-3)
    Mistral       3.9e-3                      3.5e-2              1.5e-4
    Qwen3         2.0e-3        3.9e-3        3.9e-2              3.8e-5   (3.8e-3)
    Phi-3         2.8e-3                      4.1e-2              -
    Gemma 2       5.4e-3        3.4e-3        1.2e-2              1.7e-4   (6.2e-3)
    Gemma 3       4.6e-4                      1.0e-2              -
    GPT-OSS       3.4e-3                      5.0e-2              -
    DeepSeek-V2   2.2e-3        7.4e-3        3.1e-2              -
    DeepSeek-V3   4.9e-3                      3.8e-2              -

Against Hugging Face eager float32 the fp32 export is *not* much closer than the fp16 export on these
models: their attention is sharp (weights 1.5 / sqrt(fan_in), Gemma 2's scores beyond its softcap), and the
float16 rounding the node requires — Q / K / V at its input (K and V are what the fp16 caches hold), the
cos/sin tables, the output — dominates both. That rounding alone, applied to Hugging Face itself
(`node_boundary_fp16`), moves HF's logits by 2.6e-3 (Llama), 2.0e-3 (Qwen3), 5.0e-3 (Gemma 2): it is the
error fp16 caches justify, and FP32_TOL = 8e-3 is 1.5x the largest of those (Gemma 2) and below every
2%-wrong-scale figure (the smallest: Gemma 3's 1.0e-2, Gemma 2's 1.2e-2). bf16 caches (T bfloat16, 3 fewer
mantissa bits: 8x the rounding) measure 2.1e-2 on Llama, checked at 4e-2.

What float32 does buy is exactness everywhere else: against HF with exactly that fp16 rounding at the
node's boundary, the fp32 export agrees within 1.7e-4, the fp16 export only within 3.5e-3 .. 6.2e-3, so
NODE_TOL = 1e-3 (6x the worst fp32 figure, 3.5x below the best fp16 one) is what tells an fp32 graph from
one that computes anything outside attention in fp16 (`test_llama_fp32_node_boundary_bound_has_teeth`).
The emulation needs Llama-shaped HF attention (q/k/v/o_proj, the module's apply_rotary_pos_emb); Phi-3's
fused qkv_proj, Gemma 3's per-layer-type tables, GPT-OSS's rotary and DeepSeek's absorbed MLA get the
FP32_TOL check only. CI runs every family's parity (each well under a second on these tiny models), Llama's teeth,
runtime, cache and int4 checks and every family's graph checks.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from export_utils import (assert_close_logits, assert_valid_export, attention_attrs, check_parity, export_tiny,
                          hf_greedy_sequence, io_signature, mutated_export, run_tokens, save_tiny_checkpoint,
                          tiny_model)

FP32_TOL = 8e-3  # fp32 export vs HF eager float32 (see the module doc)
NODE_TOL = 1e-3  # fp32 export vs HF eager with fp16 rounding at the attention node's boundary
F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16


def _r16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(x.dtype)


class node_boundary_fp16:
    """Context manager: HF eager (Llama-shaped attention: q/k/v/o_proj, the modeling module's
    apply_rotary_pos_emb and eager_attention_forward) with float16 rounding exactly where an fp32 export's
    PagedAttention node has it: the Q/K/V projections' outputs (the Casts in front of the node), the cos/sin
    tables and the q/k norm gains (float16 initializers), Q, K and V after RoPE (Q is a T tensor in the
    kernel's prologue, K / V what the fp16 caches hold) and the attention output (the node's output)."""

    def __init__(self, hf):
        self.hf, self.mod = hf, importlib.import_module(type(hf).__module__)

    def __enter__(self):
        self.hooks, self.saved, self.gains = [], {}, []
        for layer in self.hf.model.layers:
            a = layer.self_attn
            for proj in (a.q_proj, a.k_proj, a.v_proj):
                self.hooks.append(proj.register_forward_hook(lambda m, i, o: _r16(o)))
            self.hooks.append(a.o_proj.register_forward_pre_hook(lambda m, i: (_r16(i[0]),)))
            for n in ("q_norm", "k_norm"):
                norm = getattr(a, n, None)
                if norm is not None:
                    self.gains.append((norm.weight, norm.weight.detach().clone()))
        with torch.no_grad():
            for w, _ in self.gains:
                w.copy_(_r16(w))
        m = self.mod
        attend, rope = m.eager_attention_forward, m.apply_rotary_pos_emb
        self.saved = dict(eager_attention_forward=attend, apply_rotary_pos_emb=rope)
        m.eager_attention_forward = lambda mod, q, k, v, *a, **kw: attend(mod, _r16(q), _r16(k), _r16(v), *a, **kw)
        m.apply_rotary_pos_emb = lambda q, k, cos, sin, *a, **kw: rope(q, k, _r16(cos), _r16(sin), *a, **kw)
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        for k, v in self.saved.items():
            setattr(self.mod, k, v)
        with torch.no_grad():
            for w, orig in self.gains:
                w.copy_(orig)
        return False


# ---- tiny models of every family (the configs of tests/test_export_<family>.py) --------------------------

def _gemma2():
    from test_export_gemma2 import tiny_gemma2

    return tiny_gemma2()


def _gemma3():
    from test_export_gemma3 import ROPE

    return tiny_model("Gemma3TextConfig", seed=8, num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                      layer_types=["sliding_attention", "sliding_attention", "full_attention"], rope_parameters=ROPE)


def _gpt_oss():
    from test_export_gpt_oss import YARN

    return tiny_model("GptOssConfig", seed=7, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                      rope_parameters=YARN)


def _deepseek(version: str):
    from test_export_deepseek import V2, V3, V3_BIAS, deepseek

    if version == "v2":
        return deepseek("DeepseekV2Config", seed=11, **V2)
    return deepseek("DeepseekV3Config", seed=6, bias=V3_BIAS, router_gain=0.1, **V3)


WINDOWED = dict(prompt_lens=(11, 37), chunk=16)  # the ring of block_table_windowed wraps
# name -> (model factory, check_parity keywords, node_boundary_fp16 applies)
FAMILIES = {
    "llama": (lambda: tiny_model("LlamaConfig", seed=1), {}, True),
    "mistral": (lambda: tiny_model("MistralConfig", seed=2, sliding_window=8), dict(prompt_lens=(5, 29)), True),
    "qwen3": (lambda: tiny_model("Qwen3Config", seed=4, rms_norm_eps=1e-5), {}, True),
    "phi3": (lambda: tiny_model("Phi3Config", seed=5, sliding_window=8, original_max_position_embeddings=256), {},
             False),
    "gemma2": (_gemma2, WINDOWED, True),
    "gemma3": (_gemma3, WINDOWED, False),
    "gpt_oss": (_gpt_oss, WINDOWED, False),
    "deepseek_v2": (lambda: _deepseek("v2"), {}, False),
    "deepseek_v3": (lambda: _deepseek("v3"), {}, False),
}


# ---- the graph ------------------------------------------------------------------------------------------

def assert_fp32_graph(model_dir: Path, t: int = F16, cache: int | None = None) -> None:
    """Every PagedAttention node runs in T = `t` between Casts; nothing else in the graph is float16 /
    bfloat16: the Casts are exactly those around the nodes, the float initializers are float32 except the
    nodes' T-typed constants; caches of type `cache` (default t), logits float32; paged-validate clean."""
    from pagedkit.validators import validate_model
    from pagedkit.validators.contract import PAGED_ATTENTION

    model_dir = Path(model_dir)
    assert validate_model(str(model_dir)) == []
    m = onnx.load(str(model_dir / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in m.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    t_inputs = [p for p in PAGED_ATTENTION.inputs if p.type_param == "T"]
    nodes = [n for n in m.graph.node if n.op_type == "PagedAttention"]
    assert nodes
    node_casts, t_consts = set(), set()
    for n in nodes:
        for p in t_inputs:
            name = n.input[p.index] if p.index < len(n.input) else ""
            if not name:
                continue
            if name in inits:  # cos/sin, head_sink, q/k norm weights: initializers of T
                assert inits[name].data_type == t, (n.name, p.name, inits[name].data_type)
                t_consts.add(name)
            else:  # query (packed QKV), key, value: a Cast float32 -> T
                cast = producer[name]
                assert cast.op_type == "Cast" and cast.attribute[0].i == t, (n.name, p.name, cast.op_type)
                node_casts.add(cast.name)
        users = consumers[n.output[0]]
        assert [u.op_type for u in users] == ["Cast"] and users[0].attribute[0].i == F32, (n.name, users)
        node_casts.add(users[0].name)
    for n in m.graph.node:  # no Cast to a half type except the ones feeding the attention nodes
        if n.op_type == "Cast" and n.name not in node_casts:
            assert n.attribute[0].i not in (F16, BF16), n.name
    floats = (F32, F16, BF16)
    halves = sorted(i.name for i in m.graph.initializer if i.data_type in (F16, BF16) and i.name not in t_consts)
    assert halves == [], f"half-precision initializers outside the attention nodes: {halves[:5]}"
    assert any(i.data_type == F32 for i in m.graph.initializer if i.data_type in floats)
    sig = io_signature(model_dir / "model.onnx")
    assert sig["logits"] == ("output", F32, 2)
    for name, (_, elem, _) in sig.items():
        if name.startswith(("past_key_values.", "present.")) and not name.endswith("_scale"):
            assert elem == (cache or t), (name, elem)
    # the config says what the graph is: activations float32, caches float16 (onnxruntime-genai reads the
    # tensor types from the graph; the pagedkit section records them)
    from pagedkit.interface import read_pagedkit_section

    section = read_pagedkit_section(model_dir)
    assert section["dtype"] == "float32"


@pytest.fixture(scope="module")
def llama():
    return FAMILIES["llama"][0]()


@pytest.fixture(scope="module")
def llama32_dir(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_fp32")
    res = export_tiny(llama, out, dtype="fp32")
    assert res.spec.dtype == "float32"
    assert "K float16 / V float16" in res.summary()
    return out


@pytest.fixture(scope="module")
def llama16_dir(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("llama_fp16")
    export_tiny(llama, out)
    return out


def test_llama_fp32_graph(llama32_dir, llama16_dir):
    assert_valid_export(llama32_dir)  # paged-validate, onnx.checker full_check, onnxruntime_genai.Config
    assert_fp32_graph(llama32_dir)
    m = onnx.load(str(llama32_dir / "model.onnx"))
    names = [n.name for n in m.graph.node]
    i = names.index("/model/layers.0/attn/PagedAttention")
    assert names[i - 1] == "/model/layers.0/attn/PagedAttention/query/Cast"
    assert names[i + 1] == "/model/layers.0/attn/PagedAttention/output/Cast"
    for a in attention_attrs(llama32_dir / "model.onnx"):
        assert a["scale"] == pytest.approx(16 ** -0.5) and a["do_rotary"] == 1
        assert "key" not in a["inputs"]  # packed QKV, cast as one tensor
    cfg = json.loads((llama32_dir / "genai_config.json").read_text())
    section = json.loads(cfg["pagedkit"])
    assert section["layers"][0]["k_cache"]["dtype"] == "float16" == section["layers"][0]["v_cache"]["dtype"]
    cfg16 = json.loads((llama16_dir / "genai_config.json").read_text())
    # the onnxruntime-genai part of the config does not depend on the dtype (its readers take tensor
    # types from the graph); only the pagedkit section's "dtype" differs
    assert {k: v for k, v in cfg.items() if k != "pagedkit"} == {k: v for k, v in cfg16.items() if k != "pagedkit"}
    s16 = json.loads(cfg16["pagedkit"])
    assert {k: v for k, v in section.items() if k != "dtype"} == {k: v for k, v in s16.items() if k != "dtype"}
    assert (section["dtype"], s16["dtype"]) == ("float32", "float16")


def test_llama_fp32_parity(llama, llama32_dir):
    rep = check_parity(llama, llama32_dir, tol=FP32_TOL)
    with node_boundary_fp16(llama):
        node = check_parity(llama, llama32_dir, tol=NODE_TOL)
    print(f"llama fp32: vs HF fp32 {rep.worst_ratio:.3g} (bound {FP32_TOL}), vs HF with node-boundary fp16 "
          f"{node.worst_ratio:.3g} (bound {NODE_TOL}); near-ties {rep.near_ties}")


def test_llama_fp32_node_boundary_bound_has_teeth(llama, llama16_dir):
    """The fp16 export of the same model (fp16 outside attention too) fails NODE_TOL."""
    with node_boundary_fp16(llama):
        rep = check_parity(llama, llama16_dir, tol=math.inf, greedy=False)
    print(f"llama fp16 export vs HF with node-boundary fp16: {rep.worst_ratio:.3g} (NODE_TOL {NODE_TOL})")
    assert rep.worst_ratio > NODE_TOL


@pytest.mark.parametrize("factor", [1.02, 0.98], ids=["scale+2%", "scale-2%"])
def test_llama_fp32_parity_has_teeth(llama, llama32_dir, tmp_path, factor):
    """A 2% wrong attention scale fails the FP32_TOL check against HF float32 (measured 4.8e-2)."""
    bad = mutated_export(llama32_dir, tmp_path / "bad", scale=factor * 16 ** -0.5)
    with pytest.raises(AssertionError, match="max\\|diff\\|"):
        check_parity(llama, bad, steps=2, tol=FP32_TOL)
    rep = check_parity(llama, bad, tol=math.inf, greedy=False)
    print(f"llama fp32 teeth, scale x{factor}: worst {rep.worst_ratio:.3g} vs bound {FP32_TOL}")
    assert rep.worst_ratio > 3 * FP32_TOL


def test_fp32_runs_in_generator(llama, llama32_dir):
    """pagedkit's Generator (KV block manager, paged plan) on the fp32 export: greedy tokens equal HF's,
    and pagedkit.runtime.parity passes at FP32_TOL."""
    from pagedkit.runtime.generate import Generator
    from pagedkit.runtime.parity import hf_logits, parity

    prompt = [5, 17, 33, 9, 101, 64, 12]
    gen = Generator(llama32_dir, shuffle_seed=3)
    ours = [s.token for s in gen.greedy(prompt, 12, stop_at_eos=False)]
    ids, _ = hf_greedy_sequence(llama, prompt, 12)
    rep = parity(gen.history, hf_logits(llama, gen.history.token_ids), FP32_TOL)
    assert rep.ok, "\n".join(rep.lines())
    assert ours == ids[len(prompt):] or all(s.near_tie for s in rep.disagreements), (ours, ids[len(prompt):])
    print(f"Generator on the fp32 export: max rel {rep.max_rel:.3g}; Generator.dtype {gen.dtype}")


# ---- other cache types, int4 weights -----------------------------------------------------------------------

def test_fp32_with_bf16_caches(llama, tmp_path):
    """--kv-cache bf16: unquantized caches hold T, so the nodes run in bfloat16 (Casts to bfloat16)."""
    from pagedkit.exporters.families.base import KVOptions

    export_tiny(llama, tmp_path, dtype="fp32", kv=KVOptions(k_dtype="bfloat16", v_dtype="bfloat16"))
    assert_valid_export(tmp_path)
    assert_fp32_graph(tmp_path, t=BF16)
    rep = check_parity(llama, tmp_path, tol=4e-2, near_tie=4e-2)  # bf16 keeps 8 mantissa bits (fp16 11)
    print(f"llama fp32 with bf16 caches: worst {rep.worst_ratio:.3g}")


def test_fp32_with_int8_cache(llama, tmp_path):
    """A quantized cache (calibrated PER_CHANNEL: the calibration runs the unquantized fp32 graph, fp16
    caches) keeps T float16; checked against HF attending over the export's own dequantized cache."""
    from export_quant_utils import check_quantized_parity

    from pagedkit.exporters.families.base import KVOptions

    res = export_tiny(llama, tmp_path, dtype="fp32", kv=KVOptions(k_dtype="int8", v_dtype="int8",
                                                                   k_quant="PER_CHANNEL", v_quant="PER_CHANNEL"))
    assert_valid_export(tmp_path)
    assert_fp32_graph(tmp_path, t=F16, cache=TensorProto.INT8)
    stats = check_quantized_parity(llama, tmp_path)
    print("fp32 + int8 PER_CHANNEL:", res.summary(), stats)


def test_fp32_int4_weights(llama, tmp_path):
    """--weights int4: MatMulNBits with float32 activations and scales; the same graph with MatMuls over the
    decoded weights gives the same logits (float32 both: a tight bound). accuracy_level 0 (the activations'
    own type): the default 4 lets pagedkit's runtime run the bfloat16 int4 kernel (runtime/ops/nbits.py,
    1.8e-2 here), which tests/test_export_int4.py bounds."""
    from export_quant_utils import dequantized_matmul_model

    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions

    out = tmp_path / "int4"
    export_hf_model(llama, out, ExportOptions(dtype="fp32", progress=False), weight_format="int4",
                    int4_accuracy_level=0)
    assert_valid_export(out)
    m = onnx.load(str(out / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    nbits = [n for n in m.graph.node if n.op_type == "MatMulNBits"]
    assert nbits and "MatMul" not in [n.op_type for n in m.graph.node]
    assert all(inits[n.input[2]].data_type == F32 for n in nbits)  # scales (T1) float32: float32 activations
    halves = [i.name for i in m.graph.initializer if i.data_type == F16 and not i.name.startswith(("cos", "sin"))]
    assert halves == []
    dequantized_matmul_model(out, tmp_path / "deq")
    toks, lens = [], (9, 21)
    for n in lens:
        ids, _ = hf_greedy_sequence(llama, list(range(3, 3 + n)), 3)
        toks.append(ids)
    got, ref = run_tokens(out, toks, lens), run_tokens(tmp_path / "deq", toks, lens)
    worst = assert_close_logits(got, ref, tol=1e-4, what="fp32 int4 weights vs decoded-weight MatMuls")
    print(f"fp32 int4 weights vs decoded MatMuls: {worst:.3g}")


def test_float32_constant_of_a_node_is_converted_once():
    """A T-typed constant a family made in float32 reaches the node as one float16 copy, shared."""
    from pagedkit.exporters.attention import _to_attention_type
    from pagedkit.exporters.graph import GraphBuilder

    g = GraphBuilder(F32, F16)
    w = g.initializer("bias", torch.tensor([1.0, 2.5e-4, -3.0]))
    assert g.vi[w][0] == F32
    a, b = _to_attention_type(g, w, "unused"), _to_attention_type(g, w, "unused")
    assert a == b == "bias/FLOAT16" and g.vi[a][0] == F16
    assert sum(t.name == a for t in g.initializers) == 1 and not g.nodes
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(g.initializers[-1].proto()),
                                  np.array([1.0, 2.5e-4, -3.0], np.float16))
    x = g.node("Relu", [w], "act", out_type=F32, out_shape=(3,))  # an activation: a Cast
    y = _to_attention_type(g, x, "act/Cast")
    assert g.nodes[-1].op_type == "Cast" and g.vi[y][0] == F16


# ---- every family ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_exports_fp32(family, tmp_path):
    """Each family's fp32 export is valid and has the fp32 graph structure (no run: CI-fast)."""
    make, _, _ = FAMILIES[family]
    export_tiny(make(), tmp_path, dtype="fp32")
    assert_valid_export(tmp_path)
    assert_fp32_graph(tmp_path)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_family_fp32_parity(family, tmp_path):
    """Parity with HF float32 within FP32_TOL, and (Llama-shaped attention) with HF under node-boundary fp16
    rounding within NODE_TOL; a 2% wrong scale fails FP32_TOL."""
    make, kw, boundary = FAMILIES[family]
    hf = make()
    export_tiny(hf, tmp_path / "m", dtype="fp32")
    if family.startswith("deepseek"):  # and HF's routing on the test sequences is no near-tie
        from test_export_deepseek import parity as routed_parity

        rep, _ = routed_parity(hf, tmp_path / "m", tol=FP32_TOL, **kw)
    else:
        rep = check_parity(hf, tmp_path / "m", tol=FP32_TOL, **kw)
    line = f"{family} fp32: vs HF fp32 {rep.worst_ratio:.3g}"
    if boundary:
        with node_boundary_fp16(hf):
            node = check_parity(hf, tmp_path / "m", tol=NODE_TOL, **kw)
        line += f", vs HF with node-boundary fp16 {node.worst_ratio:.3g}"
    scale = attention_attrs(tmp_path / "m" / "model.onnx")[0].get("scale")
    if scale:
        bad = mutated_export(tmp_path / "m", tmp_path / "bad", scale=1.02 * scale)
        teeth = check_parity(hf, bad, tol=math.inf, greedy=False, **kw)
        line += f"; scale x1.02: {teeth.worst_ratio:.3g}"
        assert teeth.worst_ratio > FP32_TOL, line
    print(line)


# ---- CLI ---------------------------------------------------------------------------------------------------

def test_cli_fp32(llama, tmp_path, capsys):
    from pagedkit.exporters.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "fp32" in capsys.readouterr().out
    ckpt = save_tiny_checkpoint(llama, tmp_path / "hf")
    out = tmp_path / "out"
    rc = main(["--model", str(ckpt), "--output", str(out), "--dtype", "fp32", "--num-layers", "1", "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "K float16 / V float16" in text
    assert_valid_export(out)
    assert_fp32_graph(out)
    m = onnx.load(str(out / "model.onnx"))
    w = next(i for i in m.graph.initializer if i.name == "model.layers.0.attn.qkv_proj.MatMul.weight")
    assert w.data_type == F32  # loaded in float32, not rounded through fp16
    ref = torch.cat([llama.model.layers[0].self_attn.q_proj.weight, llama.model.layers[0].self_attn.k_proj.weight,
                     llama.model.layers[0].self_attn.v_proj.weight]).t().detach().numpy()
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(w), ref)


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "fp32", "--k-cache", "bf16", "--v-cache", "fp16"], "share one dtype"),
    (["--dtype", "fp64"], "invalid choice: 'fp64'"),
], ids=["fp32-mixed-float-caches", "unknown-dtype"])
def test_cli_fp32_bad_combinations_one_line(llama, tmp_path, capsys, argv, message):
    from pagedkit.exporters.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path), "--output", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([l for l in err if "error:" in l]) == 1 and message in err[-1], err
    assert not (tmp_path / "out").exists()


def test_api_fp32_mixed_float_caches_refused(llama, tmp_path):
    from pagedkit.exporters.families.base import KVOptions

    with pytest.raises(ValueError, match="dtype fp32: K cache bfloat16 and V cache float16 differ") as exc:
        export_tiny(llama, tmp_path, dtype="fp32", kv=KVOptions(k_dtype="bfloat16", v_dtype="float16"))
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="dtype: expected one of fp16, bf16, fp32, got 'fp64'"):
        export_tiny(llama, tmp_path, dtype="fp64")
