"""paged-export, DeepSeek V2 / V3: MLA absorbed into one PagedAttention node per layer (kv_cache_layout
LATENT, v_head_size = kv_lora_rank, kv_num_heads 1, rotary_offset = kv_lora_rank, explicit scale with the
YaRN mscale^2), W_UV after the op, MoE with shared experts.

- tiny random V2-like (q_proj, greedy softmax routing -> com.microsoft::MoE, biased MLPs, YaRN) and V3-like
  (q_lora_rank, sigmoid + e_score_correction_bias + group-limited routing, norm_topk_prob,
  routed_scaling_factor, biased attention projections, YaRN with attention factor != 1, interleaved and
  rotate_half RoPE) exported fp16: prefill + 16 teacher-forced decode steps over a shuffled block table
  == HF eager fp32 within 2e-2 x max|ref| (tests/export_utils.py), greedy agreement except near-ties;
- routing is a discrete decision: a swapped expert moves the output by its weight times the difference of two
  experts' outputs, a jump, so an fp16 graph can only be held to fp32 HF where no decision is closer than fp16
  noise. The end-to-end tests are built without near-ties and assert it (`parity`: every router decision HF
  makes on the test sequences has a margin >= ROUTING_MARGIN): the V2 model routes every token to all of
  its experts (k = E: softmax weights, no decision), the V3 model's e_score_correction_bias makes its
  decisions static with wide margins (the group limit still decides: the groups kept by top-2 sums exclude
  the best single expert). Token-dependent top-k and group routing of every variant is checked exactly in
  float32 on 400 tokens against HF's MoE module;
- the parity check's teeth: 1/sqrt(head_size) as scale, or the other rotary layout, must fail it;
- bf16 (V2): against the bf16 checkpoint within export_utils.BF16_TOL with greedy agreement; a 5% wrong
  scale must fail it (slow);
- slow: `paged-export --model deepseek-v2-lite --num-layers 2` (real V2-Lite dims, 8 routed experts).
"""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto

from export_utils import (BF16_TOL, assert_valid_export, attention_attrs, bf16_weights, check_parity, export_tiny,
                          io_signature, tiny_model)

# The smallest k-th vs (k+1)-th choice-score gap (and group-score gap) of the reference that fp16 parity needs
# for renormalized routing: > 4x the largest fp16-vs-fp32 choice-score deviation measured on these models
# (2.4e-3 with the router gain 0.3, 4.7e-3 at gain 1; V3_BIAS's test runs at gain 0.1).
ROUTING_MARGIN = 1e-2

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, head_dim=8,
           num_key_value_heads=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32.0, beta_slow=1.0)
V2 = MLA | dict(q_lora_rank=None, n_routed_experts=6, num_experts_per_tok=6, routed_scaling_factor=1.5,
                mlp_bias=True, rope_parameters=YARN | dict(mscale=0.707, mscale_all_dim=0.707))
V3 = MLA | dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                norm_topk_prob=True, routed_scaling_factor=2.5, num_hidden_layers=3, attention_bias=True,
                rope_parameters=YARN | dict(mscale=1.0, mscale_all_dim=0.8))
# groups of 2 experts: top-2 sums A 0.5, B 3.5, C 1.5, D -0.5 -> keep B, C -> experts 2, 3, 4 (margins 1.0 and
# 0.5 before the sigmoid scores, which vary by about +-0.15 at router gain 0.1). Without the group limit, or
# with groups ranked by their best expert, expert 0 would be chosen.
V3_BIAS = [3.0, -2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]


def deepseek(cls: str, seed: int, bias: float | list[float] = 0.5, router_gain: float = 1.0, **overrides):
    """A tiny random model (tests/export_utils.tiny_model), router weights scaled by router_gain, V3's
    e_score_correction_bias random with std `bias` or the given values."""
    hf = tiny_model(cls, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is None:
                continue
            gate.weight.mul_(router_gain)
            b = getattr(gate, "e_score_correction_bias", None)
            if b is not None:  # a buffer (tiny_model randomizes parameters only)
                b.copy_(torch.tensor(bias) if isinstance(bias, list) else bias * torch.randn(b.shape, generator=gen))
    return hf


# ---- routing margins (oracle side: recomputed from HF's router inputs, independent of the export) ----------

def _choice_margins(cfg, gate, x: torch.Tensor) -> torch.Tensor:
    """Per token: the smallest gap of HF's routing decisions (topk_group-th vs next group score, then
    k-th vs (k+1)-th choice score among the kept groups)."""
    logits = x.reshape(-1, gate.weight.shape[1]).float() @ gate.weight.float().t()
    v2 = cfg.model_type == "deepseek_v2"
    choice = logits.softmax(-1) if v2 else logits.sigmoid() + gate.e_score_correction_bias
    n_exp, k = choice.shape[-1], gate.top_k
    margin = torch.full((choice.shape[0],), math.inf)
    if not v2 or cfg.topk_method == "group_limited_greedy":
        groups, kept = gate.num_group, gate.topk_group
        grouped = choice.view(-1, groups, n_exp // groups)
        gs = grouped.max(-1).values if v2 else grouped.topk(2, -1)[0].sum(-1)
        s = gs.sort(-1, descending=True).values
        if kept < groups:
            margin = s[:, kept - 1] - s[:, kept]
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(kept, -1)[1], 1.0).bool()
        choice = grouped.masked_fill(~keep[..., None], -math.inf).view(-1, n_exp)
    s = choice.sort(-1, descending=True).values
    if k < n_exp:
        margin = torch.minimum(margin, s[:, k - 1] - s[:, k])
    return margin


class routing_margins:
    """Context manager recording the smallest routing margin of every router call of the HF model."""

    def __init__(self, hf):
        self.hf, self.smallest = hf, math.inf

    def __enter__(self):
        def hook(gate, args, out):
            self.smallest = min(self.smallest, float(_choice_margins(self.hf.config, gate, args[0]).min()))

        self.handles = [l.mlp.gate.register_forward_hook(hook) for l in self.hf.model.layers if hasattr(l.mlp, "gate")]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False


def parity(hf, model_dir, margin: float = ROUTING_MARGIN, **kw):
    """check_parity, after asserting that HF's routing on the test sequences is `margin` away from a tie."""
    failure = None
    with routing_margins(hf) as rm:
        try:
            rep = check_parity(hf, model_dir, **kw)
        except AssertionError as exc:
            failure = exc
    assert rm.smallest >= margin, (
        f"a routing decision of the reference is a near-tie (margin {rm.smallest:.3g} < {margin}): "
        f"the fp16 graph cannot be expected to make the same discrete choice ({failure})")
    if failure is not None:
        raise failure
    return rep, rm.smallest


# ---- tiny exports -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v2():
    return deepseek("DeepseekV2Config", seed=11, **V2)


@pytest.fixture(scope="module")
def v2_dir(v2, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek_v2")
    export_tiny(v2, out)
    return out


def assert_latent_nodes(model_dir, hf, interleaved: int):
    cfg = hf.config
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    attrs = attention_attrs(model_dir / "model.onnx")
    assert len(attrs) == cfg.num_hidden_layers
    for i, a in enumerate(attrs):
        assert a["kv_cache_layout"] == "LATENT" and a["v_head_size"] == rank and a["kv_num_heads"] == 1
        assert a["num_heads"] == cfg.num_attention_heads
        assert a["rotary_offset"] == rank and a["do_rotary"] == 1 and a.get("rotary_interleaved", 0) == interleaved
        assert a["scale"] == pytest.approx(hf.model.layers[i].self_attn.scaling, rel=1e-6)
        assert a["scale"] != pytest.approx((rank + rope) ** -0.5, rel=1e-3)
        assert a["inputs"]["key_cache"] == f"past_key_values.{i}.key"
        assert "value" not in a["inputs"] and "value_cache" not in a["inputs"]
    sig = io_signature(model_dir / "model.onnx")
    for i in range(cfg.num_hidden_layers):
        assert sig[f"past_key_values.{i}.key"] == ("input", TensorProto.FLOAT16, 4)
        assert sig[f"present.{i}.key"] == ("output", TensorProto.FLOAT16, 4)
        assert f"past_key_values.{i}.value" not in sig and f"present.{i}.value" not in sig
    m = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    cache = next(vi for vi in m.graph.input if vi.name == "past_key_values.0.key")
    dims = [d.dim_value or d.dim_param for d in cache.type.tensor_type.shape.dim]
    assert dims[2:] == [1, rank + rope]


def test_v2_parity_fp16(v2, v2_dir):
    """q_proj, greedy softmax routing as com.microsoft::MoE (k = E here; x routed_scaling_factor), biased
    dense and shared MLPs, YaRN, interleaved (complex) RoPE."""
    assert_valid_export(v2_dir)
    assert_latent_nodes(v2_dir, v2, interleaved=1)
    m = onnx.load(str(v2_dir / "model.onnx"))
    assert [n.domain for n in m.graph.node if n.op_type == "MoE"] == ["com.microsoft"]
    rep, margin = parity(v2, v2_dir)
    print(f"deepseek-v2 tiny: worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}, routing margin {margin:.3g}")


def test_v2_genai_config(v2_dir):
    """LATENT layers: only past_key_values.{i}.key -> present.{i}.key (contract-decisions §8)."""
    from pagedkit.exporters.config import read_pagedkit_section

    cfg = json.loads((v2_dir / "genai_config.json").read_text())
    dec = cfg["model"]["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert "past_value_names" not in dec["inputs"] and "present_value_names" not in dec["outputs"]
    assert dec["num_key_value_heads"] == 1 and dec["head_size"] == 40
    layers = read_pagedkit_section(v2_dir)["layers"]
    assert [(l["layout"], l["kv_num_heads"], l["head_size"], l["v_head_size"], l["v_cache"]) for l in layers] == \
        [("LATENT", 1, 40, 32, None)] * 2


def _mutated(src, dst, **attrs):
    """A copy of an export with attributes overwritten on every PagedAttention node. External data is copied
    once and reused when dst already holds it (links are refused by onnx and by the runtime)."""
    m = onnx.load(str(src / "model.onnx"), load_external_data=False)
    for n in m.graph.node:
        if n.op_type == "PagedAttention":
            for k, v in attrs.items():
                for a in list(n.attribute):
                    if a.name == k:
                        n.attribute.remove(a)
                n.attribute.append(onnx.helper.make_attribute(k, v))
    dst.mkdir(exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"))
    data = src / "model.onnx.data"
    if data.exists() and not (dst / data.name).exists():
        shutil.copyfile(data, dst / data.name)
    shutil.copyfile(src / "genai_config.json", dst / "genai_config.json")
    return dst


@pytest.mark.parametrize("attrs", [dict(scale=40 ** -0.5), dict(rotary_interleaved=0)],
                         ids=["scale-1/sqrt(head_size)", "rotate-half-rope"])
def test_v2_parity_has_teeth(v2, v2_dir, tmp_path, attrs):
    bad = _mutated(v2_dir, tmp_path / "bad", **attrs)
    with pytest.raises(AssertionError, match="max\\|diff\\|"):
        check_parity(v2, bad, steps=2)


@pytest.mark.parametrize("interleave", [True, False], ids=["rope-interleave", "rope-rotate-half"])
def test_v3_parity_fp16(tmp_path, interleave):
    """q_lora_rank, sigmoid + bias + group-limited routing (plain ONNX), norm_topk_prob, scaling factor,
    biased attention projections, YaRN attention factor folded into cos/sin, 3 layers."""
    hf = deepseek("DeepseekV3Config", seed=6, bias=V3_BIAS, router_gain=0.1, **(V3 | dict(rope_interleave=interleave)))
    assert hf.model.rotary_emb.attention_scaling != pytest.approx(1.0)
    export_tiny(hf, tmp_path)
    assert_valid_export(tmp_path)
    assert_latent_nodes(tmp_path, hf, interleaved=int(interleave))
    m = onnx.load(str(tmp_path / "model.onnx"))
    assert [n.domain for n in m.graph.node if n.op_type == "MoE"] == ["com.microsoft"] * 2  # routed choice fed in
    rep, margin = parity(hf, tmp_path)
    print(f"deepseek-v3 tiny ({'interleaved' if interleave else 'rotate_half'}): worst {rep.worst_ratio:.4g}, "
          f"near-ties {rep.near_ties}, routing margin {margin:.3g}")


# ---- quantized LATENT cache (PER_TOKEN) ---------------------------------------------------------------------

class substitute_latent:
    """Context manager: layer i of HF's MLA attention uses the given latent rows [S, rank + rope] (the
    export's cache, dequantized; float32) instead of its own [RMSNorm(compressed_kv) ‖ RoPE(k_pe)], and
    records its own rows in `seen`. The cache holds k_pe as the node rotates it; V3 with rope_interleave
    de-interleaves ([evens | odds]), so its rows are permuted to HF's layout."""

    def __init__(self, hf, rows: dict[int, torch.Tensor]):
        self.hf, self.rows, self.seen = hf, rows, {}
        self.module = __import__(type(hf.model.layers[0].self_attn).__module__, fromlist=["x"])
        self.names = [n for n in ("apply_rotary_emb", "apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave")
                      if hasattr(self.module, n)]
        cfg = hf.config
        self.rank = cfg.kv_lora_rank
        self.deinterleave = cfg.model_type != "deepseek_v2" and getattr(cfg, "rope_interleave", True)

    def __enter__(self):
        stash = []

        def grab(i):
            def hook(module, args, out):
                stash.append((i, out))
            return hook

        self.hooks = [l.self_attn.kv_a_layernorm.register_forward_hook(grab(i))
                      for i, l in enumerate(self.hf.model.layers)]
        self.orig = {n: getattr(self.module, n) for n in self.names}
        rank = self.rank

        def wrap(fn):
            def rotated(q, k, *args, **kwargs):
                q, k = fn(q, k, *args, **kwargs)  # k: [1, 1, S, rope]
                i, c = stash.pop()  # c [1, S, rank]: the tensor the attention goes on to use (viewed)
                self.seen[i] = torch.cat([c[0], k[0, 0]], dim=-1).detach().clone()
                sub = self.rows[i]
                pe = sub[:, rank:]
                if self.deinterleave:
                    pe = torch.cat([pe[:, 0::2], pe[:, 1::2]], dim=-1)
                c.copy_(sub[None, :, :rank].to(c.dtype))
                return q, pe[None, None].to(k.dtype)
            return rotated

        for n, fn in self.orig.items():
            setattr(self.module, n, wrap(fn))
        return self

    def __exit__(self, *exc):
        for n, fn in self.orig.items():
            setattr(self.module, n, fn)
        for h in self.hooks:
            h.remove()
        return False


@torch.no_grad()
def check_latent_quantized_parity(hf, model_dir, fmt: str, *, prompt_lens=(11, 37), steps: int = 4) -> float:
    """A PER_TOKEN-quantized LATENT export vs HF eager whose MLA attends over the export's own cache rows
    (dequantized with its stored scales), so the fp16 tolerance applies unchanged; and the cache codes are
    HF's own latent quantized: stored scales = amax / qmax within 2^-8, rows within one code step."""
    from export_utils import NEAR_TIE, TOL, PagedRunner, _Seq, hf_greedy_sequence
    from pagedkit.kernels import quant as kq

    rng = np.random.default_rng(0)
    seqs = [_Seq(hf_greedy_sequence(hf, [int(t) for t in rng.integers(3, hf.config.vocab_size, n)], steps)[0])
            for n in prompt_lens]
    runner = PagedRunner(model_dir)
    got = [[o] for o in runner.step(seqs, list(prompt_lens))]
    for _ in range(steps):
        for b, o in enumerate(runner.step(seqs, [1] * len(seqs))):
            got[b].append(o)
    width = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    worst = 0.0
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        rows, scales, codes = {}, {}, {}
        for i in range(hf.config.num_hidden_layers):
            stored = torch.cat([runner.caches[f"past_key_values.{i}.key"][blk] for blk in s.blocks])[:n]
            codes[i] = kq.dequantize(stored, 1.0, fmt, head_size=width)[:, 0]  # [n, W] integer codes
            scales[i] = torch.cat([runner.caches[f"past_key_values.{i}.key_scale"][blk] for blk in s.blocks])[:n]
            rows[i] = codes[i] * scales[i].float()  # [n, 1] scale per token
        with substitute_latent(hf, rows) as sub:
            ref = hf(torch.tensor([s.tokens])).logits[0].float().numpy()
        out = np.concatenate(got[b])
        ratio = float(np.abs(out - ref).max() / np.abs(ref).max())
        worst = max(worst, ratio)
        assert ratio <= TOL, f"sequence {b}: max|diff| = {ratio:.3g} x max|ref| > {TOL}"
        for j in range(n):
            top = np.sort(ref[j])[-2:]
            assert out[j].argmax() == ref[j].argmax() or top[1] - top[0] < NEAR_TIE * np.abs(ref).max()
        for i in rows:  # the codes are HF's latent quantized (fp16 row, fp16 per-token scale)
            x = sub.seen[i].to(torch.float16).float()
            if sub.deinterleave:  # HF's [evens | odds] back to the cache's interleaved pairs
                r, pe = hf.config.kv_lora_rank, x[:, hf.config.kv_lora_rank:]
                x = torch.cat([x[:, :r], torch.stack(pe.chunk(2, dim=-1), dim=-1).reshape(n, -1)], dim=-1)
            sc, stored = kq.per_token_scale(x, fmt).float(), scales[i].float()
            rel = float(((stored - sc).abs() / sc).max())
            assert rel <= 2.0 ** -8, f"layer {i}: PER_TOKEN scales differ by {rel:.3g} (relative)"
            # HF's row quantized with the stored scale: the same codes, except one step where fp16 vs fp32
            # rounding straddles a code boundary
            diff = (codes[i] - kq.dequantize(kq.quantize(x, stored, fmt), 1.0, fmt, head_size=width)).abs()
            assert float(diff.max()) <= 1.0 and float((diff > 0).float().mean()) <= 0.1, (
                f"layer {i}: codes differ by up to {float(diff.max()):.3g} steps on "
                f"{float((diff > 0).float().mean()):.1%} of the elements")
    return worst


@pytest.mark.parametrize("case", ["v2-int8", "v2-int4", "v3-int8"])
def test_latent_per_token_cache(v2, tmp_path, case):
    """A PER_TOKEN-quantized LATENT cache: one scale cache per layer (key side only), k_quant_type on the
    node, parity with HF attending over the export's dequantized latent (not with plain HF: the cache is
    what makes it pass). v3: interleaved RoPE, whose cached k_pe HF holds de-interleaved."""
    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions, KVOptions

    model, fmt = case.split("-")
    hf = v2 if model == "v2" else deepseek("DeepseekV3Config", seed=6, bias=V3_BIAS, router_gain=0.1, **V3)
    res = export_hf_model(hf, tmp_path, ExportOptions(kv=KVOptions(fmt, fmt, "PER_TOKEN", "PER_TOKEN"),
                                                      progress=False))
    assert_valid_export(tmp_path)
    sig = io_signature(tmp_path / "model.onnx")
    assert sig["past_key_values.0.key_scale"] == ("input", TensorProto.FLOAT16, 3)
    assert not any(name.endswith((".value", ".value_scale")) for name in sig)
    for a in attention_attrs(tmp_path / "model.onnx"):
        assert a["k_quant_type"] == "PER_TOKEN" and a.get("v_quant_type", "NONE") == "NONE"
        assert a.get("k_cache_dtype", "") == ("int4" if fmt == "int4" else "")
    worst = check_latent_quantized_parity(hf, tmp_path, fmt)
    print(f"LATENT {case} PER_TOKEN: worst {worst:.4g} vs HF over the export's latent; {res.notes}")
    with pytest.raises(AssertionError, match="max\\|diff\\|"):
        check_parity(hf, tmp_path, steps=2)


# ---- MoE block in float32 (exact routing) ---------------------------------------------------------------

def _mlp_graph(hf, layer: int):
    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.exporters.registry import family_for

    g = GraphBuilder(TensorProto.FLOAT)
    x = g.input("x", TensorProto.FLOAT, ("num_tokens", hf.config.hidden_size))
    ctx = SimpleNamespace(g=g, config=hf.config)
    y = family_for(hf.config).mlp(ctx, layer, hf.model.layers[layer].mlp, x)
    g.output(y, TensorProto.FLOAT, ("num_tokens", hf.config.hidden_size))
    return g.model("moe", "test"), y


def test_v2_unknown_topk_method_names_it():
    """V2 routes greedy or group_limited_greedy only (as Hugging Face's gate): another method is refused by name,
    not exported as greedy."""
    hf = deepseek("DeepseekV2Config", seed=21, **(V2 | dict(n_routed_experts=8, num_experts_per_tok=3,
                                                             topk_method="noaux_tc", n_group=4, topk_group=2)))
    with pytest.raises(NotImplementedError, match="topk_method 'noaux_tc' is not supported"):
        _mlp_graph(hf, 1)


@pytest.mark.parametrize("case", ["v2-greedy", "v2-group-limited", "v3", "v3-no-norm"])
def test_moe_block_fp32_exact(case):
    """The exported MoE block (routing + experts + shared experts) in float32 == HF's module on 400 tokens."""
    from pagedkit.runtime.session import InferenceSession

    if case.startswith("v2"):
        extra = dict(n_routed_experts=8, num_experts_per_tok=3)  # token-dependent top-k
        if case == "v2-group-limited":
            extra |= dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)
        hf = deepseek("DeepseekV2Config", seed=21, **(V2 | extra))
    else:
        hf = deepseek("DeepseekV3Config", seed=22, **(V3 | dict(norm_topk_prob=case == "v3")))
    model, y = _mlp_graph(hf, 1)
    ops = {n.op_type for n in model.graph.node}
    assert "MoE" in ops and ("ScatterElements" in ops) == (case != "v2-greedy")  # routed choice fed to the node
    x = torch.randn(400, hf.config.hidden_size, generator=torch.Generator().manual_seed(3))
    gate = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        ref = hf.model.layers[1].mlp(x[None])[0]
        margin = float(_choice_margins(hf.config, gate, x).min())
        if case != "v2-greedy":  # the group limit changes the choice of some tokens
            _, _, idx = gate(x)
            logits = x @ gate.weight.t()
            plain = (logits.softmax(-1) if case.startswith("v2") else logits.sigmoid() + gate.e_score_correction_bias)
            plain = plain.topk(gate.top_k, -1)[1]
            changed = (idx.sort(-1).values != plain.sort(-1).values).any(-1).float().mean()
            assert changed > 0.1, f"only {changed:.0%} of the tokens route differently with the group limit"
    got = InferenceSession(model).run_torch({"x": x})[y]
    err = float((got - ref).abs().max()) / float(ref.abs().max())
    print(f"{case}: max|diff|/max|ref| = {err:.3g}, routing margin {margin:.3g}")
    assert margin > 1e-5  # float32 noise is ~1e-7: the decisions are well defined
    assert err <= 1e-5


@pytest.fixture(scope="module")
def v2_bf16_dir(v2, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek_v2_bf16")
    export_tiny(v2, out, dtype="bf16")
    return out


def test_v2_bf16(v2, v2_bf16_dir):
    """bf16 graph (float32 logits, as onnxruntime-genai). Against HF float32 weights: 8x fp16's tolerance
    (bf16 keeps 8 mantissa bits, fp16 11), without the greedy check (fp16's near-tie threshold); that bound
    passes a 5% wrong scale. Against the bf16 checkpoint (weights rounded to bf16, float32 compute):
    BF16_TOL, greedy agreement asserted with near-ties at bf16's bound (test_v2_bf16_parity_has_teeth)."""
    assert_valid_export(v2_bf16_dir)
    sig = io_signature(v2_bf16_dir / "model.onnx")
    assert sig["past_key_values.0.key"][1] == TensorProto.BFLOAT16 and sig["logits"][1] == TensorProto.FLOAT
    rep = check_parity(v2, v2_bf16_dir, steps=4, tol=8 * 2e-2, greedy=False)
    print(f"deepseek-v2 tiny bf16 vs HF fp32: worst {rep.worst_ratio:.4g}, "
          f"argmax differences {rep.near_ties + rep.mismatches}")
    rep, margin = parity(bf16_weights(v2), v2_bf16_dir, tol=BF16_TOL, near_tie=BF16_TOL)
    print(f"deepseek-v2 tiny bf16 vs its bf16 checkpoint: worst {rep.worst_ratio:.4g} (bound {BF16_TOL}), "
          f"near-ties {rep.near_ties}, routing margin {margin:.3g}")


@pytest.mark.slow
@pytest.mark.parametrize("factor", [1.05, 0.95], ids=["scale+5%", "scale-5%"])
def test_v2_bf16_parity_has_teeth(v2, v2_bf16_dir, tmp_path, factor):
    """A 5% wrong attention scale on the bf16 export fails the bf16 parity bound (it passed 8 x 2e-2 against
    HF float32: 0.12). Slow (two full 16-step runs); CI keeps Llama's bf16 teeth (test_export_llama.py)."""
    scale = attention_attrs(v2_bf16_dir / "model.onnx")[0]["scale"]
    bad = _mutated(v2_bf16_dir, tmp_path / "bad", scale=factor * scale)
    # the whole run's worst step (check_parity with tol=BF16_TOL fails at the first step above it)
    rep = check_parity(bf16_weights(v2), bad, tol=math.inf, greedy=False)
    print(f"deepseek-v2 bf16 teeth, scale x{factor}: worst {rep.worst_ratio:.4g} vs bound {BF16_TOL}")
    assert rep.worst_ratio > BF16_TOL


def test_latent_rejects_rotation_and_v_options(v2, tmp_path):
    from pagedkit.exporters.families.base import ExportOptions, KVOptions
    from pagedkit.exporters.export import export_hf_model

    with pytest.raises(ValueError, match="rotate-kv"):
        export_hf_model(v2, tmp_path / "a", ExportOptions(kv=KVOptions(rotate=True), progress=False))
    with pytest.raises(ValueError, match="LATENT cache"):
        export_hf_model(v2, tmp_path / "b", ExportOptions(kv=KVOptions(v_dtype="int8", v_quant="PER_TOKEN"),
                                                          progress=False))
    # --k-cache alone (V left at its default) is the LATENT cache's setting
    from pagedkit.exporters.registry import family_for

    spec = family_for(v2.config).model_spec(v2, ExportOptions(kv=KVOptions(k_dtype="int8", k_quant="PER_TOKEN")))
    assert [(l.k_cache.dtype, l.k_cache.quant, l.v_cache) for l in spec.layers] == [("int8", "PER_TOKEN", None)] * 2


# ---- real V2-Lite dimensions (slow) --------------------------------------------------------------------

V2_LITE_SCALE = 0.1147213867929261  # yarn_get_mscale(40, 0.707)^2 / sqrt(128 + 64)


@pytest.mark.slow
def test_paged_export_deepseek_v2_lite(tmp_path, capsys):
    """`paged-export --model deepseek-v2-lite --num-layers 2 --num-experts 8`: real V2-Lite dims (hidden 2048,
    16 heads, kv_lora_rank 512, rope 64, nope 128, v 128, vocab 102400; layer 0 dense, layer 1 MoE with 8 of
    64 routed experts, top-6, 2 shared), random weights. Validator clean, exact LATENT attributes, parity
    with HF; the teeth: scale 1/sqrt(576) or the rotate_half RoPE layout must fail the parity check. The
    weights are HF's own init, whose routing margins this test does not control (it prints the smallest)."""
    from pagedkit.exporters.cli import main
    from pagedkit.exporters.weights import load_model

    out = tmp_path / "v2lite"
    rc = main(["--model", "deepseek-v2-lite", "--num-layers", "2", "--num-experts", "8", "--max-seq-len", "512",
               "--output", str(out), "--quiet"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    print(printed.out)
    assert_valid_export(out)
    attrs = attention_attrs(out / "model.onnx")
    assert len(attrs) == 2
    for a in attrs:
        assert (a["kv_cache_layout"], a["v_head_size"], a["kv_num_heads"], a["rotary_offset"], a["num_heads"],
                a.get("rotary_interleaved", 0), a["do_rotary"]) == ("LATENT", 512, 1, 512, 16, 1, 1)
        assert a["scale"] == np.float32(V2_LITE_SCALE)  # the attribute is a float32
    # the same random weights as the CLI built (same seed, built in the export dtype), run by HF eager in
    # float32 with a float32 rotary module (its inverse frequencies are not rounded to fp16)
    hf = load_model("deepseek-v2-lite", num_layers=2, num_experts=8, seed=0, dtype=torch.float16).model.float()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config)
    assert hf.model.layers[0].self_attn.scaling == V2_LITE_SCALE
    kw = dict(prompt_lens=(11, 37), steps=3)
    rep, margin = parity(hf, out, margin=0.0, **kw)  # HF's own init: margins not controlled, reported
    print(f"deepseek-v2-lite (2 layers): worst {rep.worst_ratio:.4g}, near-ties {rep.near_ties}, "
          f"routing margin {margin:.3g}")
    for bad_attrs in (dict(scale=576 ** -0.5), dict(rotary_interleaved=0)):
        bad = _mutated(out, tmp_path / "bad", **bad_attrs)
        with pytest.raises(AssertionError, match="max\\|diff\\|") as exc:
            check_parity(hf, bad, **kw)
        print(f"teeth {bad_attrs}: {str(exc.value).splitlines()[0]}")
