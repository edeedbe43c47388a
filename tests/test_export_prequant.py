"""Pre-quantized checkpoints (pagedkit/exporters/checkpoint.py, prequant.py), built here from known float weights
with this file's own packing code (it shares nothing with pagedkit's readers):
- DeepSeek-V3's FP8 release form (float8_e4m3fn weights, float32 weight_scale_inv per 128 x 128 block, partial
  blocks at the edges): the exported initializers equal the dequantized weights this file computes (float32
  product, then the export dtype), and the model runs against Hugging Face eager over those weights;
- GPTQ (v1 zero - 1 storage, v2, symmetric) and AWQ (GEMM packing order) int4: every linear becomes MatMulNBits
  whose dequantization by onnxruntime's CPU kernel (the node alone, fed the identity) equals this file's
  dequantization of the checkpoint; teeth: a nibble order swapped, the AWQ order ignored or GPTQ's zero off by
  one in pagedkit's reader fails the check; an act-order g_idx is refused naming the tensor.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from export_utils import check_parity, tiny_model

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
LLAMA = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


# ---- int4 forms, written here ------------------------------------------------------------------------------

def quantize(w: np.ndarray, group: int, rng, zero_free_group: bool = False):
    """w [N, K] -> codes q [K, N], zeros z [G, N] (0..15), scales s [G, N] float16: asymmetric round to nearest
    per group of `group` rows of K. Codes are nudged at random so that every value 0..15 occurs."""
    n, k = w.shape
    wt = w.T.reshape(k // group, group, n)
    lo, hi = np.minimum(wt.min(1), 0), np.maximum(wt.max(1), 0)
    s = ((hi - lo) / 15).astype(np.float16)
    z = np.clip(np.round(-lo / s.astype(np.float32)), 0, 15).astype(np.int64)
    if zero_free_group:
        z[0, :] = 0  # a zero of 0: GPTQ v1 stores it as 15 and reads 16 (its own off-by-one wrap)
    q = np.clip(np.round(wt / s[:, None].astype(np.float32)) + z[:, None], 0, 15).astype(np.int64)
    q = np.where(rng.random(q.shape) < 0.05, rng.integers(0, 16, q.shape), q)
    return q.reshape(k, n), z, s


def pack_rows(q: np.ndarray, order=range(8)) -> np.ndarray:
    """int codes [R * 8, C] -> int32 words [R, C], code 8r + i in nibble i."""
    r = q.shape[0] // 8
    out = np.zeros((r, q.shape[1]), np.uint32)
    for i, j in enumerate(order):
        out |= (q[j::8].astype(np.uint32) & 0xF) << (4 * i)
    return out.view(np.int32)


def pack_cols(q: np.ndarray, order=range(8)) -> np.ndarray:
    """int codes [R, C * 8] -> int32 words [R, C], nibble i holding column 8c + order[i]."""
    return np.ascontiguousarray(pack_rows(np.ascontiguousarray(q.T), order).T)


def dequant(q, z, s, g_idx) -> np.ndarray:
    """W [N, K] float64 = (q - z) * s of each row's group."""
    return ((q - z[g_idx]) * s[g_idx].astype(np.float64)).T


def write_int4(folder, hf, method: str, group: int = 32, fmt: str = "gptq", sym: bool = False,
               act_order: bool = False, zero_free: bool = False) -> dict[str, np.ndarray]:
    """The checkpoint of `hf` with its decoder linears in `method`'s int4 form; returns prefix -> W [N, K]."""
    from safetensors.torch import save_file

    rng = np.random.default_rng(7)
    tensors, oracle = {}, {}
    for name, p in hf.state_dict().items():
        prefix = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and prefix.split(".", 3)[-1] in LINEARS):
            tensors[name] = p.detach().to(torch.float16).contiguous()
            continue
        w = p.detach().double().numpy()
        q, z, s = quantize(w, group, rng, zero_free_group=zero_free and prefix.endswith("q_proj"))
        if sym:
            z[:] = 8
        g_idx = np.arange(w.shape[1]) // group
        if act_order:
            g_idx = rng.permutation(g_idx)
        if method == "gptq":
            stored = (z - 1) & 0xF if fmt == "gptq" else z
            packed = dict(qweight=pack_rows(q), qzeros=pack_cols(stored), g_idx=g_idx.astype(np.int32))
        else:
            packed = dict(qweight=pack_cols(q, AWQ_ORDER), qzeros=pack_cols(z, AWQ_ORDER))
        packed["scales"] = s
        zero = np.where(z == 0, 16, z) if (method == "gptq" and fmt == "gptq") else z  # v1 reads stored + 1
        oracle[prefix] = dequant(q, zero, s, g_idx)
        tensors.update({f"{prefix}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in packed.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf.config.to_dict()
    cfg["quantization_config"] = (
        dict(quant_method="gptq", bits=4, group_size=group, desc_act=act_order, sym=sym, checkpoint_format=fmt)
        if method == "gptq" else dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return oracle


def nbits_dequantized(model_dir) -> dict[str, np.ndarray]:
    """node name -> W^T [K, N] as onnxruntime's CPU MatMulNBits computes it: the node alone, x = identity."""
    import onnxruntime as ort

    model = onnx.load(str(model_dir / "model.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n = attrs["K"], attrs["N"]
        single = helper.make_node("MatMulNBits", ["x"] + list(node.input[1:]), ["y"], domain="com.microsoft", **attrs)
        g = helper.make_graph([single], "one", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [k, k])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [k, n])],
                              [inits[i] for i in node.input[1:] if i])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        out[node.name] = sess.run(None, {"x": np.eye(k, dtype=np.float32)})[0]
    return out


def check_int4(tmp_path, method: str, **kw) -> None:
    """Export the int4 checkpoint (fp32: the identity product is exact) and compare every MatMulNBits node with
    the oracle (packed QKV: q, k, v rows concatenated); bound: 1e-6 relative (float32 rounding of the kernel's
    zero-point product)."""
    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions

    hf = tiny_model("LlamaConfig", seed=5, **LLAMA)
    (tmp_path / "ckpt").mkdir()
    oracle = write_int4(tmp_path / "ckpt", hf, method, **kw)
    export(str(tmp_path / "ckpt"), tmp_path / "out", ExportOptions(dtype="fp32", progress=False))
    got = nbits_dequantized(tmp_path / "out")
    assert len(got) == 5 * hf.config.num_hidden_layers
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}"
        want = {f"/model/layers.{i}/attn/qkv_proj/MatMul_Q4": np.concatenate(
                    [oracle[f"{p}.self_attn.{x}_proj"] for x in "qkv"]),
                f"/model/layers.{i}/attn/o_proj/MatMul_Q4": oracle[f"{p}.self_attn.o_proj"]}
        want |= {f"/model/layers.{i}/mlp/{x}/MatMul_Q4": oracle[f"{p}.mlp.{x}"] for x in ("gate_proj", "up_proj",
                                                                                           "down_proj")}
        for node, w in want.items():
            err = np.abs(got[node] - w.T).max() / np.abs(w).max()
            assert err <= 1e-6, (node, err)


@pytest.mark.parametrize("form", ["gptq-v1", "gptq-v1-zero0", "gptq-v2", "gptq-sym", "awq"])
def test_int4_checkpoint_maps_onto_matmulnbits(form, tmp_path, monkeypatch):
    """(gptq-v1, gptq-sym and awq with the weights in external data, the others in model.onnx: both writers let
    the packed words read for one linear go once it is written: never more than Q, K and V's at a time.)"""
    import pagedkit.exporters.export as ex
    from pagedkit.exporters import slicing

    if form in ("gptq-v1", "gptq-sym", "awq"):
        monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    held = []
    real_whole = slicing.whole

    def whole(x):
        value = real_whole(x)
        held.append(len(slicing._whole_cache))
        return value

    monkeypatch.setattr(slicing, "whole", whole)
    kw = {"gptq-v1": dict(), "gptq-v1-zero0": dict(zero_free=True), "gptq-v2": dict(fmt="gptq_v2"),
          "gptq-sym": dict(sym=True), "awq": dict()}[form]
    check_int4(tmp_path, form.split("-")[0], **kw)
    assert held and max(held) <= 3 and not slicing._whole_cache, max(held)
    nodes = [n for n in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.node if n.op_type == "MatMulNBits"]
    zps = {len(n.input) for n in nodes}
    assert zps == ({3} if form == "gptq-sym" else {4})  # symmetric: no zero points (the default 8)


@pytest.mark.parametrize("bug", ["nibble-order", "awq-order", "zero-off-by-one"])
def test_int4_check_has_teeth(bug, tmp_path, monkeypatch):
    """The check fails on realistic reader bugs: the two nibbles of a byte swapped, AWQ's packing order taken as
    plain, GPTQ v1's stored zero used without its + 1."""
    import pagedkit.exporters.prequant as pq

    if bug == "nibble-order":
        real = pq._nibbles
        monkeypatch.setattr(pq, "_nibbles", lambda w: real(w)[..., [1, 0, 3, 2, 5, 4, 7, 6]])
    elif bug == "awq-order":
        monkeypatch.setattr(pq, "_AWQ_COLUMNS", torch.arange(8))
    else:
        real_post = pq.Int4Source.__post_init__

        def post(self):
            real_post(self)
            self.zero_plus_one = False
        monkeypatch.setattr(pq.Int4Source, "__post_init__", post)
    with pytest.raises(AssertionError):
        check_int4(tmp_path, "awq" if bug == "awq-order" else "gptq")


def test_act_order_gptq_is_refused_naming_the_tensor(tmp_path):
    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions

    hf = tiny_model("LlamaConfig", seed=5, **LLAMA)
    (tmp_path / "ckpt").mkdir()
    write_int4(tmp_path / "ckpt", hf, "gptq", act_order=True)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.g_idx: act-order"):
        export(str(tmp_path / "ckpt"), tmp_path / "out", ExportOptions(progress=False), validate=False)


def test_gptq_model_runs_against_its_dequantized_weights(tmp_path):
    """The fp16 export of a GPTQ checkpoint (MatMulNBits everywhere) against Hugging Face eager float32 over the
    oracle's dequantized weights: the whole graph (packed QKV, MLP) uses the right rows."""
    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions

    hf = tiny_model("LlamaConfig", seed=5, **LLAMA)
    (tmp_path / "ckpt").mkdir()
    oracle = write_int4(tmp_path / "ckpt", hf, "gptq")
    ref = tiny_model("LlamaConfig", seed=5, **LLAMA)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            prefix = name.rsplit(".", 1)[0]
            p.copy_(torch.from_numpy(oracle[prefix]).float() if prefix in oracle else p.half().float())
    export(str(tmp_path / "ckpt"), tmp_path / "out", ExportOptions(progress=False))
    check_parity(ref, tmp_path / "out", steps=4)


# ---- DeepSeek-V3 FP8 ------------------------------------------------------------------------------------------

FP8_V3 = dict(hidden_size=160, intermediate_size=272, kv_lora_rank=32, q_lora_rank=136, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=24, head_dim=8, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, moe_intermediate_size=144, first_k_dense_replace=1, n_routed_experts=4,
              num_experts_per_tok=2, n_group=2, topk_group=1, num_hidden_layers=2, norm_topk_prob=True,
              routed_scaling_factor=2.5)


def fp8_checkpoint(folder, hf) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's release form of `hf` (per-expert tensors; projections float8_e4m3fn + float32
    weight_scale_inv per 128 x 128 block, edge blocks partial); returns key -> the dequantized float32 weight
    (float32 product of code and block scale, DeepSeek's weight_dequant)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(3)
    tensors, oracle = {}, {}
    state = hf.state_dict()
    for name, p in state.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            parts = {}
            for e in range(p.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = p[e].chunk(2, 0)
                    parts |= {name.replace("gate_up_proj", f"{e}.gate_proj.weight"): gate,
                              name.replace("gate_up_proj", f"{e}.up_proj.weight"): up}
                else:
                    parts[name.replace("down_proj", f"{e}.down_proj.weight")] = p[e]
        else:
            parts = {name: p}
        for key, w in parts.items():
            if w.dim() != 2 or "embed" in key or "lm_head" in key or key.endswith("gate.weight"):
                tensors[key] = w.detach().to(torch.bfloat16) if w.dtype == torch.float32 and "bias" not in key \
                    else w.detach()
                continue
            rows, cols = w.shape
            br, bc = -(-rows // 128), -(-cols // 128)
            scale = torch.rand(br, bc, generator=gen) * 1e-3 + 2e-3
            code = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
            deq = torch.empty(rows, cols)
            for i in range(br):
                for j in range(bc):
                    blk = (slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
                    code[blk] = (w.detach()[blk] / scale[i, j]).to(torch.float8_e4m3fn)
                    deq[blk] = code[blk].to(torch.float32) * scale[i, j]
            tensors[key], tensors[key + "_scale_inv"], oracle[key] = code, scale, deq
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = hf.config.to_dict() | {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                         "activation_scheme": "dynamic",
                                                         "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(cfg))
    return oracle


def check_fp8(tmp_path, monkeypatch, parity: bool = True) -> None:
    """Initializers equal this file's dequantization rounded to fp16 (bit for bit), experts interleaved and
    stacked, MLA's absorbed kv_b_proj heads too — written in 2 KB chunks, so that rows are read from the
    middle of 128-row scale blocks; the model runs against HF eager over the dequantized weights."""
    import pagedkit.exporters.checkpoint as ck
    import pagedkit.exporters.export as ex
    import pagedkit.exporters.external as ext
    from pagedkit.exporters.families.base import ExportOptions

    hf = tiny_model("DeepseekV3Config", seed=4, **FP8_V3)
    (tmp_path / "ckpt").mkdir()
    oracle = fp8_checkpoint(tmp_path / "ckpt", hf)
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    monkeypatch.setattr(ext, "CHUNK_BYTES", 2048)
    monkeypatch.setattr(ck, "READ_BYTES", 4096)  # whole reads converted 128 rows (one scale block) at a time
    ex.export(str(tmp_path / "ckpt"), tmp_path / "out", ExportOptions(progress=False))
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "out" / "model.onnx")).graph.initializer}

    def fp16(key):
        return oracle[key].to(torch.float16).numpy()

    L = "model.layers"
    eq = np.testing.assert_array_equal
    eq(inits["model.layers.0.attn.q_a_proj.MatMul.weight"], fp16(f"{L}.0.self_attn.q_a_proj.weight").T)
    eq(inits["model.layers.1.attn.o_proj.MatMul.weight"], fp16(f"{L}.1.self_attn.o_proj.weight").T)
    eq(inits["model.layers.0.mlp.down_proj.MatMul.weight"], fp16(f"{L}.0.mlp.down_proj.weight").T)
    kv_b = fp16(f"{L}.1.self_attn.kv_b_proj.weight").reshape(4, 16 + 24, 32)  # [H, nope + dv, rank]
    eq(inits["model.layers.1.attn.kv_b_proj.W_UK"], kv_b[:, :16])
    eq(inits["model.layers.1.attn.kv_b_proj.W_UV_T"], kv_b[:, 16:].transpose(0, 2, 1))
    fc1 = inits["model.layers.1.mlp.experts.fc1.weight"]  # [E, 2I, H], rows gate0, up0, gate1, ...
    fc2 = inits["model.layers.1.mlp.experts.fc2.weight"]
    for e in range(4):
        eq(fc1[e, 0::2], fp16(f"{L}.1.mlp.experts.{e}.gate_proj.weight"))
        eq(fc1[e, 1::2], fp16(f"{L}.1.mlp.experts.{e}.up_proj.weight"))
        eq(fc2[e], fp16(f"{L}.1.mlp.experts.{e}.down_proj.weight"))
    if not parity:
        return
    ref = tiny_model("DeepseekV3Config", seed=4, **FP8_V3)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name in oracle:
                p.copy_(oracle[name])
            elif name.endswith("experts.gate_up_proj"):
                p.copy_(torch.stack([torch.cat([oracle[name.replace("gate_up_proj", f"{e}.{x}_proj.weight")]
                                                for x in ("gate", "up")]) for e in range(p.shape[0])]))
            elif name.endswith("experts.down_proj"):
                p.copy_(torch.stack([oracle[name.replace("down_proj", f"{e}.down_proj.weight")]
                                     for e in range(p.shape[0])]))
            else:  # stored in bfloat16
                p.copy_(p.to(torch.bfloat16).float())
    check_parity(ref, tmp_path / "out", steps=4)


def test_deepseek_v3_fp8_checkpoint_dequantizes_per_block(tmp_path, monkeypatch):
    check_fp8(tmp_path, monkeypatch)


@pytest.mark.parametrize("bug", ["column-blocks-ignored", "bf16-first", "scale-grid-transposed"])
def test_fp8_check_has_teeth(bug, tmp_path, monkeypatch):
    """Realistic dequantization bugs fail the check: one scale per 128-row band (the column blocks ignored), the
    product rounded to bfloat16 before the export dtype (as a bf16-default reference implementation would), the
    scale grid indexed [column block, row block]."""
    import pagedkit.exporters.checkpoint as ck

    real = ck.fp8_dequantize

    def buggy(w, scale_inv, block, dtype, row0=0):
        if bug == "column-blocks-ignored":
            return real(w, scale_inv[:, :1].expand(scale_inv.shape).contiguous(), block, dtype, row0)
        if bug == "bf16-first":
            return real(w, scale_inv, block, torch.bfloat16, row0).to(dtype)
        return real(w, scale_inv.t().contiguous() if scale_inv.shape[0] == scale_inv.shape[1] else
                    scale_inv.flip(1), block, dtype, row0)

    monkeypatch.setattr(ck, "fp8_dequantize", buggy)
    with pytest.raises(AssertionError):
        check_fp8(tmp_path, monkeypatch, parity=False)
