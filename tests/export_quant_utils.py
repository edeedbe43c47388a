"""Exporter test helpers for quantized exports (split from export_utils.py).

`check_quantized_parity`: exports with quantized KV caches against Hugging Face eager attending over the
export's own dequantized cache (so the fp16 tolerance applies), plus a code-level check that the cache
holds HF's K / V quantized with the exported scales. `dequantized_matmul_model`: the oracle of int4-weight
exports (MatMulNBits replaced by MatMuls over weights decoded here).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from export_utils import NEAR_TIE, TOL, PagedRunner, _Seq, attention_attrs, hf_greedy_sequence


def kv_formats(model_dir: Path) -> list[list[tuple]]:
    """Per layer, per side (K, V): (format or None, quant type, static scale or None, rotated), read off the
    exported graph (cache element types, node attributes, scale initializers)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(Path(model_dir) / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    caches = {vi.name: vi.type.tensor_type.elem_type for vi in m.graph.input}
    fmts = {onnx.TensorProto.INT8: "int8", onnx.TensorProto.FLOAT8E4M3FN: "float8e4m3fn",
            onnx.TensorProto.UINT8: "int4"}
    layers = []
    for a in attention_attrs(Path(model_dir) / "model.onnx"):
        sides = []
        for s, cache in (("k", "key_cache"), ("v", "value_cache")):
            scale = a["inputs"].get(f"{s}_scale")
            scale = torch.from_numpy(numpy_helper.to_array(inits[scale]).copy()) if scale else None
            sides.append((fmts.get(caches[a["inputs"][cache]]), a.get(f"{s}_quant_type", "NONE"), scale,
                          bool(a.get("qk_rotation" if s == "k" else "v_rotation", 0))))
        layers.append(sides)
    return layers


class substitute_kv:
    """Context manager: the HF model's eager attention of layer i attends over the given K / V
    ([S, Hkv, D] float32, one sequence) instead of its own, and records the K / V it computed itself."""

    def __init__(self, hf_model, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        self.module = __import__(type(hf_model.model.layers[0].self_attn).__module__, fromlist=["x"])
        self.kv, self.seen = kv, {}

    def __enter__(self):
        self.orig = self.module.eager_attention_forward
        kv, seen, orig = self.kv, self.seen, self.orig

        def wrapped(module, query, key, value, *args, **kwargs):
            i = module.layer_idx
            seen[i] = (key[0].transpose(0, 1).clone(), value[0].transpose(0, 1).clone())  # [S, Hkv, D]
            k, v = kv[i]
            return orig(module, query, k.transpose(0, 1)[None].to(key.dtype), v.transpose(0, 1)[None].to(value.dtype),
                        *args, **kwargs)

        self.module.eager_attention_forward = wrapped
        return self

    def __exit__(self, *exc):
        self.module.eager_attention_forward = self.orig
        return False


def _rows(runner: PagedRunner, seq: _Seq, name: str, n: int) -> torch.Tensor:
    """Cache rows of positions 0..n-1 of a sequence (full-attention pool)."""
    cache = runner.caches[name]
    return torch.cat([cache[b] for b in seq.blocks])[:n]


def _dequant_side(runner, seq, layer: int, side: str, fmt_side, n: int, head_size: int) -> torch.Tensor:
    from pagedkit.kernels import quant as kq

    fmt, quant, scale, rot = fmt_side
    stored = _rows(runner, seq, f"past_key_values.{layer}.{side}", n)
    if fmt is None:
        return stored.float()
    if quant == "PER_TOKEN":
        s = _rows(runner, seq, f"past_key_values.{layer}.{side}_scale", n).float()[..., None]
    else:
        s = kq.static_scale(scale, quant, stored.shape[1], head_size)
    x = kq.dequantize(stored, s, fmt, head_size=head_size)
    return kq.hadamard(x) if rot else x


@torch.no_grad()
def check_quantized_parity(hf_model, model_dir: Path, *, prompt_lens=(11, 37), steps: int = 4, seed: int = 0,
                           tol: float = TOL, max_flip_fraction: float = 0.1) -> dict:
    """Parity for exports with quantized caches, without rounding-boundary noise in the oracle.

    The export runs prefill + `steps` teacher-forced decode steps; then, per sequence, HF eager runs the
    whole sequence with every layer attending over the export's own cache contents, dequantized (and
    rotated back) with pagedkit.kernels.quant: logits must agree within the fp16 tolerance, greedy
    choices except near-ties. Separately, the codes in the cache must be the quantization of the K / V HF
    computes at that layer (same scale): equal except one code step where fp16 vs fp32 rounding straddles
    a code boundary (fp8: one step at that magnitude, or the fp16 error relative to the range), on at most
    `max_flip_fraction` of the elements; PER_TOKEN scales equal to HF's amax / qmax within 8 fp16 ulps."""
    from pagedkit.kernels import quant as kq

    rng = np.random.default_rng(seed)
    vocab = hf_model.config.vocab_size
    seqs = []
    for n in prompt_lens:
        ids, _ = hf_greedy_sequence(hf_model, [int(t) for t in rng.integers(3, vocab, n)], steps)
        seqs.append(_Seq(ids))
    runner = PagedRunner(model_dir, seed=seed)
    assert not runner.windowed, "check_quantized_parity reads caches of full-attention layers only"
    got = [[] for _ in seqs]
    for b, o in enumerate(runner.step(seqs, list(prompt_lens))):
        got[b].append(o)
    for _ in range(steps):
        for b, o in enumerate(runner.step(seqs, [1] * len(seqs))):
            got[b].append(o)
    formats = kv_formats(model_dir)
    head = hf_model.model.layers[0].self_attn.head_dim
    stats = {"worst": 0.0, "flips": 0.0}
    for b, s in enumerate(seqs):
        n = len(s.tokens)
        kv = {i: (_dequant_side(runner, s, i, "key", f[0], n, head), _dequant_side(runner, s, i, "value", f[1], n, head))
              for i, f in enumerate(formats)}
        with substitute_kv(hf_model, kv) as sub:
            ref = hf_model(torch.tensor([s.tokens])).logits[0].float().numpy()
        out = np.concatenate(got[b])
        assert np.isfinite(out).all()
        ratio = float(np.abs(out - ref).max() / np.abs(ref).max())
        stats["worst"] = max(stats["worst"], ratio)
        assert ratio <= tol, f"sequence {b}: max|diff| = {ratio:.3g} x max|ref| > {tol}"
        for j in range(n):
            if out[j].argmax() != ref[j].argmax():
                top = np.sort(ref[j])[-2:]
                assert top[1] - top[0] < NEAR_TIE * np.abs(ref).max(), f"sequence {b} position {j}: argmax differs"
        for i, f in enumerate(formats):  # the codes are HF's K / V quantized
            for side, (fmt, quant, scale, rot), x in (("key", f[0], sub.seen[i][0]), ("value", f[1], sub.seen[i][1])):
                if fmt is None:
                    continue
                x = x.to(torch.float16).float()
                x = kq.hadamard(x) if rot else x
                if quant == "PER_TOKEN":
                    sc = kq.per_token_scale(x, fmt).float()
                    stored_sc = _rows(runner, s, f"past_key_values.{i}.{side}_scale", n).float()[..., None]
                    # the graph's K / V went through a few fp16 roundings HF's fp32 did not: amax (and so
                    # the scale, itself rounded to fp16) agrees within 8 fp16 ulps, 2^-8 relative
                    rel = float(((stored_sc - sc).abs() / sc).max())
                    assert rel <= 2.0 ** -8, f"layer {i} {side}: PER_TOKEN scales differ by {rel:.3g} (relative)"
                else:
                    sc = kq.static_scale(scale, quant, x.shape[1], x.shape[2])
                want = kq.quantize(x, sc, fmt)
                have = _rows(runner, s, f"past_key_values.{i}.{side}", n)
                if fmt == "int4":
                    want, have = kq.unpack_int4(want, head), kq.unpack_int4(have, head)
                if fmt == "float8e4m3fn":  # code values; allowed: one fp8 step at that magnitude, or the
                    w, h = want.float(), have.float()  # fp16-compute error relative to the range (2e-3 qmax)
                    mag = torch.maximum(w.abs(), h.abs()).clamp(min=2.0 ** -6)
                    step = torch.maximum(2.0 ** (torch.floor(torch.log2(mag)) - 3), torch.tensor(2e-3 * 448))
                    diff = (w - h).abs() / step
                else:
                    diff = (want.int() - have.int()).abs().float()
                flips = float((diff > 0).float().mean())
                stats["flips"] = max(stats["flips"], flips)
                assert float(diff.max()) <= 1.0 + 1e-6, f"layer {i} {side}: codes differ by {float(diff.max())} steps"
                assert flips <= max_flip_fraction, f"layer {i} {side}: {flips:.1%} of the codes differ"
    return stats


def decode_int4(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """MatMulNBits' symmetric 4-bit B (no zero points: the default 8) decoded here from the nibbles:
    packed [N, k_blocks, block / 2] uint8 (element 2i in the low nibble) or its [N, k_blocks * block / 2]
    reshape, scales [N, k_blocks] or [N * k_blocks] -> float32 [N, k] (the padding of the last block cut)."""
    n = packed.shape[0]
    scales = scales.astype(np.float32).reshape(n, -1)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, scales.shape[1], -1).astype(np.float32) - 8
    return (codes * scales[:, :, None]).reshape(n, -1)[:, :k]


def dequantized_matmul_model(model_dir: Path, out_dir: Path) -> dict[str, float]:
    """A copy of an int4-weight export with every com.microsoft MatMulNBits (4 bits, no zero points: the
    default 8) replaced by a MatMul over its weights decoded here from the packed nibbles
    (B [N, k_blocks, block_size / 2] uint8, element 2i in the low nibble, scales [N, k_blocks]), and a
    GatherBlockQuantized (the tied embedding: Reshape of the LM head's B) by a Gather over the same table
    decoded (rows padded to whole blocks, as the node's output; the export's Slice, if any, stays).
    Returns {weight name: max over blocks of max|code|} (<= 8)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(Path(model_dir) / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    producers = {o: n for n in m.graph.node for o in n.output}
    errors = {}
    for idx, node in enumerate(list(m.graph.node)):
        a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type == "GatherBlockQuantized":
            assert a["bits"] == 4 and a.get("gather_axis", 0) == 0 and a.get("quantize_axis", 1) == 1
            assert len(node.input) < 4 or not node.input[3], "no zero points expected"
            reshape = producers[node.input[0]]
            assert reshape.op_type == "Reshape", "the packed table comes from a Reshape of an initializer"
            packed = numpy_helper.to_array(inits[reshape.input[0]])
            scales = numpy_helper.to_array(inits[node.input[2]])
            table = decode_int4(packed.reshape(packed.shape[0], -1), scales, 2 * packed[0].size)
            name = node.input[2] + ".table_dequantized"
            m.graph.initializer.append(numpy_helper.from_array(table.astype(scales.dtype), name))
            new = onnx.helper.make_node("Gather", [name, node.input[1]], [node.output[0]],
                                        name=node.name + "/dequantized", axis=0)
        elif node.op_type == "MatMulNBits":
            assert a["bits"] == 4 and (len(node.input) < 4 or not node.input[3]), "4-bit symmetric expected"
            K, N = a["K"], a["N"]
            packed = numpy_helper.to_array(inits[node.input[1]])  # [N, k_blocks, bs / 2]
            scales = numpy_helper.to_array(inits[node.input[2]])
            act = scales.dtype  # T1: the activations' type (float16, or float32 for an fp32 export)
            w = decode_int4(packed, scales, K).T.astype(act)  # [K, N]
            name = node.input[1] + ".dequantized"
            m.graph.initializer.append(numpy_helper.from_array(w, name))
            new = onnx.helper.make_node("MatMul", [node.input[0], name], [node.output[0]],
                                        name=node.name + "/dequantized")
            codes = np.stack([packed & 15, packed >> 4], axis=-1).astype(np.float32) - 8
            errors[node.input[1]] = float(np.abs(codes).max())
        else:
            continue
        m.graph.node.remove(node)
        m.graph.node.insert(idx, new)
    used = {i for n in m.graph.node for i in n.input}
    for node in [n for n in m.graph.node if n.op_type == "Reshape" and n.output[0] not in used]:
        m.graph.node.remove(node)  # the Reshape that fed the GatherBlockQuantized
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    onnx.save(m, str(Path(out_dir) / "model.onnx"))
    (Path(out_dir) / "genai_config.json").write_text((Path(model_dir) / "genai_config.json").read_text())
    return errors


def int4_decoded_hf(hf_model, model_dir: Path):
    """A copy of the (Llama-shaped) HF model whose Linear weights are the export's int4 weights decoded
    (packed QKV split back into q / k / v), the LM head included when it is MatMulNBits (tied: the
    embedding too, one parameter): the float32 reference an int4 export computes, quantization aside.
    Returns (model, names of the decoded weights)."""
    import copy

    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(Path(model_dir) / "model.onnx"))
    inits = {i.name: i for i in m.graph.initializer}
    ref = copy.deepcopy(hf_model).float()
    done = []
    with torch.no_grad():
        for node in m.graph.node:
            if node.op_type != "MatMulNBits":
                continue
            a = {x.name: onnx.helper.get_attribute_value(x) for x in node.attribute}
            w = torch.from_numpy(decode_int4(numpy_helper.to_array(inits[node.input[1]]),
                                             numpy_helper.to_array(inits[node.input[2]]), a["K"]))
            path = node.input[1].removesuffix(".MatMul.weight_Q4")  # model.layers.0.attn.qkv_proj, lm_head
            if path == "lm_head":
                targets = [ref.lm_head]
            else:
                parts = path.replace(".attn.", ".self_attn.").split(".")
                mod = ref
                for part in parts[:-1]:
                    mod = getattr(mod, part)
                targets = ([mod.q_proj, mod.k_proj, mod.v_proj] if parts[-1] == "qkv_proj"
                           else [getattr(mod, parts[-1])])
            row = 0
            for lin in targets:
                n = lin.weight.shape[0]
                lin.weight.copy_(w[row:row + n])  # tied: the embedding table is this same parameter
                row += n
            assert row == w.shape[0], (path, row, w.shape)
            done.append(path)
    return ref, done
