"""KV-cache calibration and quantization reports, and int4 weights.

Calibration runs the *unquantized* export (same graph, float caches) with pagedkit's InferenceSession
over a text (default: `builtin/calibration.txt`), then reads back what the caches hold: K after QK-norm
and RoPE, V — exactly the values a quantized cache stores (rotated first when --rotate-kv). From them:
- PER_TENSOR / PER_CHANNEL scales: max-abs (or a percentile of |x|) / qmax, per layer and side
  ([1] or [kv_heads, 1, head_size], float32);
- per-layer K and V quantization SNR (dB) of the chosen format and granularity (PER_TOKEN included),
  10 log10(sum x^2 / sum (x - dequant(quant(x)))^2), using pagedkit.kernels.quant (the kernels' code).

`quantize_weights_int4` runs onnxruntime's own MatMulNBitsQuantizer (4 bits, symmetric, block 32, accuracy_level 4:
onnxruntime-genai's builder defaults for `-p int4 -e cpu`) on the graph, the LM head included (as the builder
does; `lm_head=False` keeps it float). A tied LM head (`Gemm(x, model.embed_tokens.weight, transB=1)`) becomes
a MatMul over the transposed table first, so that it is quantized like any other; the embedding Gather then
reads the same int4 weight: `Reshape` of `lm_head.MatMul.weight_Q4` to [vocab, packed row] and
com.microsoft GatherBlockQuantized (bits 4, gather_axis 0, quantize_axis 1) with the LM head's scales
(`Slice` of the padding when hidden_size is not a multiple of the block size), exactly the builder's layout;
the float table is dropped. An untied embedding stays a float Gather. `--weights int4` does the same rewrite on the graph builder with
lazy int4 weights quantized as they are written (int4_stream.py), byte for byte this function's result.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import torch

from ..interface import dtypes
from ..interface import names as N
from ..interface.genai_config import LayerSpec, ModelSpec
from ..kernels import quant as kq
from ..validators.contract import cache_format

DEFAULT_CALIBRATION_TEXT = Path(__file__).with_name("builtin") / "calibration.txt"
SEQ_LEN = 128  # tokens per calibration sequence
MAX_TOKENS = 1024


def calibration_sequences(text_file: str | Path | None, tokenizer_dir: Path | None, vocab_size: int,
                          seq_len: int = SEQ_LEN, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Token ids of the calibration text in sequences of seq_len: the model's tokenizer when its files are
    at hand, else (random-weight exports) the text's bytes folded into the vocabulary."""
    text = Path(text_file or DEFAULT_CALIBRATION_TEXT).read_text(encoding="utf-8")
    ids = None
    if tokenizer_dir is not None and (Path(tokenizer_dir) / "tokenizer_config.json").exists():
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
            ids = tok(text)["input_ids"]
            unk = tok.unk_token_id
            if unk is not None and sum(i == unk for i in ids) > len(ids) // 2:
                ids = None  # a toy tokenizer that does not know the text's words: bytes are more varied
        except Exception:  # a tokenizer transformers cannot build offline: fall back to bytes
            ids = None
    if ids is None:
        ids = [3 + b % (vocab_size - 3) for b in text.encode("utf-8")]
    ids = [int(i) for i in ids[:max_tokens]]
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 1]


@torch.no_grad()
def collect_kv(model: onnx.ModelProto, spec: ModelSpec, sequences: list[list[int]], block_size: int = 16
               ) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
    """Run the unquantized model over each sequence (one prefill each) and return, per layer, the cached
    K and V of every token: [N, kv_heads, head_size] float32."""
    try:
        from .. import InferenceSession
    except ImportError:
        from ..runtime.session import InferenceSession

    sess = InferenceSession(model)
    args = {i.name: i for i in sess.get_inputs()}
    names = set(args)

    def cache_dtype(name: str) -> torch.dtype:  # the unquantized graph's own cache type (fp16 for fp32 exports)
        return dtypes.torch_dtype(args[name].type)

    out: dict[int, list[list[torch.Tensor]]] = {l.layer: [[], []] for l in spec.layers}
    for seq in sequences:
        n = len(seq)
        nb = math.ceil(n / block_size)
        # one sequence, prefill: block_table [1, nb], cumulative [0, n], past [0], metadata [n, n, 0]
        feeds = {N.INPUT_IDS: torch.tensor(seq, dtype=torch.int64),
                 N.BLOCK_TABLE: torch.arange(nb, dtype=torch.int32)[None],
                 N.CUMULATIVE_SEQUENCE_LENGTHS: torch.tensor([0, n], dtype=torch.int32),
                 N.PAST_SEQUENCE_LENGTHS: torch.tensor([0], dtype=torch.int32),
                 N.ATTENTION_METADATA: torch.tensor([n, n, 0], dtype=torch.int32)}
        if N.BLOCK_TABLE_WINDOWED in names:  # a full-size table for the windowed layers too (pool large enough)
            feeds[N.BLOCK_TABLE_WINDOWED] = feeds[N.BLOCK_TABLE]
        for extra in N.EXTENSION_INPUTS:  # slot_mapping / query_positions [n]: 0 .. n - 1
            if extra in names:
                feeds[extra] = torch.arange(n, dtype=torch.int32)
        for l in spec.layers:  # caches [nb, block_size, kv_heads, head_size], unquantized
            key = N.past_name("key", l.layer)
            feeds[key] = torch.zeros(nb, block_size, l.kv_num_heads, l.head_size, dtype=cache_dtype(key))
            if l.v_cache is not None:
                value = N.past_name("value", l.layer)
                feeds[value] = torch.zeros(nb, block_size, l.kv_num_heads, l.head_size, dtype=cache_dtype(value))
        res = sess.run_torch(feeds)
        for l in spec.layers:
            k = res[N.present_name("key", l.layer)].reshape(nb * block_size, l.kv_num_heads, -1)[:n].float()
            out[l.layer][0].append(k)
            if l.v_cache is not None:
                v = res[N.present_name("value", l.layer)]
                out[l.layer][1].append(v.reshape(nb * block_size, l.kv_num_heads, -1)[:n].float())
    return {i: (torch.cat(k), torch.cat(v) if v else None) for i, (k, v) in out.items()}


def _amax(x: torch.Tensor, dims: tuple[int, ...], percentile: float) -> torch.Tensor:
    a = x.abs()
    if percentile >= 100.0:
        return a.amax(dim=dims, keepdim=True)
    keep = [d for d in range(a.dim()) if d not in dims]
    flat = a.permute(*dims, *keep).reshape(-1, *[a.shape[d] for d in keep]) if keep else a.reshape(-1, 1)
    q = torch.quantile(flat.double(), percentile / 100.0, dim=0).float()
    return q.reshape([1 if d in dims else a.shape[d] for d in range(a.dim())])


def static_scale_of(x: torch.Tensor, fmt: str, quant: str, percentile: float = 100.0) -> torch.Tensor:
    """Calibrated scale of x [N, Hkv, D]: PER_TENSOR [1], PER_CHANNEL [Hkv, 1, D] (float32)."""
    if quant == "PER_TENSOR":
        amax = _amax(x, (0, 1, 2), percentile).reshape(1)
    elif quant == "PER_CHANNEL":
        amax = _amax(x, (0,), percentile).reshape(x.shape[1], 1, x.shape[2])
    else:
        raise ValueError(f"static scales are PER_TENSOR or PER_CHANNEL, got {quant!r}")
    scale = amax / kq.QMAX[fmt]
    return torch.where(scale > 0, scale, torch.ones_like(scale)).float()


def _rotated(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    return kq.hadamard(x, "head_size") if rotate else x


def snr_db(x: torch.Tensor, fmt: str, quant: str, scale: torch.Tensor | None, scale_dtype=torch.float16) -> float:
    """SNR of x [N, Hkv, D] through the cache format (quantize -> dequantize), in dB."""
    d = x.shape[-1]
    if quant == "PER_TOKEN":
        s = kq.per_token_scale(x, fmt, scale_dtype).float()
    else:
        s = kq.static_scale(scale, quant, x.shape[1], d)
    xq = kq.dequantize(kq.quantize(x, s, fmt), s, fmt, head_size=d)
    noise = float(((x - xq) ** 2).sum())
    return float("inf") if noise == 0 else 10.0 * math.log10(float((x ** 2).sum()) / noise)


def calibrate(model: onnx.ModelProto, spec: ModelSpec, sequences: list[list[int]], percentile: float = 100.0
              ) -> tuple[dict[int, tuple[torch.Tensor | None, torch.Tensor | None]], dict]:
    """Static scales for the PER_TENSOR / PER_CHANNEL sides of `spec` (run on the unquantized `model`) and
    the per-layer SNR report of every quantized side."""
    kv = collect_kv(model, spec, sequences, spec.block_size)
    scales: dict[int, tuple] = {}
    report: dict[str, dict] = {}
    for l in spec.layers:
        k, v = kv[l.layer]
        pair, row = [None, None], {}
        for j, (x, cache) in enumerate(((k, l.k_cache), (v, l.v_cache))):
            if cache is None or x is None or not cache_format(cache.dtype).quantized:
                continue
            x = _rotated(x, cache.rotation)
            s = None
            if cache.quant in ("PER_TENSOR", "PER_CHANNEL"):
                s = pair[j] = static_scale_of(x, cache.dtype, cache.quant, percentile)
            row["k_snr_db" if j == 0 else "v_snr_db"] = round(snr_db(x, cache.dtype, cache.quant, s), 2)
        scales[l.layer] = tuple(pair)
        if row:
            report[str(l.layer)] = row
    meta = {"tokens": sum(len(s) for s in sequences), "percentile": percentile, "snr_db": report}
    return scales, meta


def needs_calibration(layers: list[LayerSpec]) -> bool:
    return any(c is not None and cache_format(c.dtype).quantized for l in layers for c in (l.k_cache, l.v_cache))


INT4_BLOCK_SIZE = 32  # onnxruntime-genai's builder default (int4_block_size)
# the builder's default for -e cpu / webgpu (0 for other EPs): onnxruntime's CPU kernel may quantize the
# activations to int8 blocks; pagedkit's runtime takes it as "bfloat16 activations allowed" (runtime/ops/nbits.py)
INT4_ACCURACY_LEVEL = 4
LM_HEAD_MATMUL = "/lm_head/MatMul"  # graph.linear's node name of the LM head (untied), onnxruntime-genai's too
EMBED_GATHER = "/model/embed_tokens/Gather"
EMBED_TABLE = "model.embed_tokens.weight"
TIED_HEAD_WEIGHT = "lm_head.MatMul.weight"


def quantize_weights_int4(model: onnx.ModelProto, block_size: int = INT4_BLOCK_SIZE,
                          accuracy_level: int = INT4_ACCURACY_LEVEL, lm_head: bool = True) -> onnx.ModelProto:
    """MatMul weights -> com.microsoft MatMulNBits (4 bits, symmetric) with onnxruntime's quantizer; MoE nodes'
    expert weights -> com.microsoft QMoE (quantize_moe.py).

    lm_head: quantize the LM head too (onnxruntime-genai's int4 models do); with tied embeddings the
    embedding Gather becomes GatherBlockQuantized over the LM head's int4 weight and scales. False: the LM
    head (and a tied embedding table) stays float."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if accuracy_level not in range(5):
        raise ValueError(f"accuracy_level: expected 0..4, got {accuracy_level!r}")
    tied = _tied_head(model) if lm_head else None
    if tied is not None:
        _untie_head(model, tied)
    exclude = [] if lm_head else [n.name for n in model.graph.node if n.name == LM_HEAD_MATMUL]
    q = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=True,
                             accuracy_level=accuracy_level or None, nodes_to_exclude=exclude,
                             op_types_to_quantize=("MatMul",))
    q.process()
    model = q.model.model
    if tied is not None:
        _quantized_embedding(model, tied.output[0])
    from .quantize_moe import quantize_moe_int4  # com.microsoft MoE experts -> QMoE (4 bits, same block size)

    quantize_moe_int4(model, block_size)
    return model


def _consumers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if name in n.input]


def _init(model: onnx.ModelProto, name: str) -> onnx.TensorProto | None:
    return next((t for t in model.graph.initializer if t.name == name), None)


def _tied_head(model: onnx.ModelProto) -> onnx.NodeProto | None:
    """The tied LM head `Gemm(x, model.embed_tokens.weight, transB=1)` when the table also feeds the
    embedding Gather (and nothing else), else None."""
    users = _consumers(model, EMBED_TABLE)
    gemm = [n for n in users if n.op_type == "Gemm" and list(n.input) == [n.input[0], EMBED_TABLE]]
    gather = [n for n in users if n.op_type == "Gather" and n.input[0] == EMBED_TABLE]
    if len(gemm) != 1 or len(gather) != 1 or len(users) != 2 or _init(model, EMBED_TABLE) is None:
        return None
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in gemm[0].attribute}
    if attrs != {"transB": 1}:
        return None
    return gemm[0]


def _untie_head(model: onnx.ModelProto, gemm: onnx.NodeProto) -> None:
    """Gemm(x, E [V, H], transB=1) -> MatMul(x, lm_head.MatMul.weight = E^T [H, V]) named /lm_head/MatMul,
    in place (the quantizer takes MatMuls; the float table still feeds the Gather until it is replaced)."""
    from onnx import numpy_helper

    table = _init(model, EMBED_TABLE)
    v, h = table.dims
    if table.HasField("raw_data") and table.raw_data:  # any 2/4-byte float type, bfloat16 included
        width = onnx.helper.tensor_dtype_to_np_dtype(table.data_type).itemsize
        flat = np.frombuffer(table.raw_data, dtype=f"u{width}").reshape(v, h)
        t = onnx.TensorProto(name=TIED_HEAD_WEIGHT, data_type=table.data_type, dims=[h, v],
                             raw_data=flat.T.copy().tobytes())
    else:
        t = numpy_helper.from_array(numpy_helper.to_array(table).T.copy(), TIED_HEAD_WEIGHT)
    model.graph.initializer.append(t)
    idx = list(model.graph.node).index(gemm)
    matmul = onnx.helper.make_node("MatMul", [gemm.input[0], TIED_HEAD_WEIGHT], list(gemm.output), name=LM_HEAD_MATMUL)
    model.graph.node.remove(gemm)
    model.graph.node.insert(idx, matmul)


def _const_i64(model: onnx.ModelProto, values: list[int]) -> str:
    name = f"/model/constants/INT64/{values}"
    if _init(model, name) is None:
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.asarray(values, "int64"), name))
    return name


def _quantized_embedding(model: onnx.ModelProto, logits_src: str) -> None:
    """The embedding Gather over the float table -> GatherBlockQuantized over the int4 LM head (the
    MatMulNBits producing `logits_src`): Reshape B [V, k_blocks, block / 2] to [V, k_blocks * block / 2],
    the head's scales [V, k_blocks] (and zero points if any), Slice of the padding when K is not whole
    blocks. Consumers of the Gather's output read the new output; the float table is removed."""
    head = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and n.output[0] == logits_src)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    k, n_out, block, bits = attrs["K"], attrs["N"], attrs["block_size"], attrs["bits"]
    packed, scales = head.input[1], head.input[2]
    zp = head.input[3] if len(head.input) > 3 and head.input[3] else ""
    b = _init(model, packed)
    k_blocks = -(-k // block)
    assert list(b.dims) == [n_out, k_blocks, block * bits // 8], (list(b.dims), n_out, k_blocks, block)
    s = _init(model, scales)
    if len(s.dims) == 1:  # [N * k_blocks] -> [N, k_blocks]: GatherBlockQuantized wants the data's rank
        s.dims[:] = [n_out, k_blocks]
    gather = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[0] == EMBED_TABLE)
    base = EMBED_GATHER.rsplit("/", 1)[0]  # /model/embed_tokens
    row = k_blocks * block * bits // 8
    nodes = [onnx.helper.make_node("Reshape", [packed, _const_i64(model, [n_out, row])], [f"{base}/Reshape/output_0"],
                                   name=f"{base}/Reshape")]
    gbq_in = [f"{base}/Reshape/output_0", gather.input[1], scales] + ([zp] if zp else [])
    out = f"{base}/GatherBlockQuantized/output_0"
    nodes.append(onnx.helper.make_node("GatherBlockQuantized", gbq_in, [out], name=f"{base}/GatherBlockQuantized",
                                       domain="com.microsoft", bits=bits, block_size=block, gather_axis=0,
                                       quantize_axis=1))
    if k_blocks * block != k:  # rows padded to whole blocks: drop the padding
        sl = [out, _const_i64(model, [0]), _const_i64(model, [k]), _const_i64(model, [-1])]
        out = f"{base}/Slice/output_0"
        nodes.append(onnx.helper.make_node("Slice", sl, [out], name=f"{base}/Slice"))
    old = gather.output[0]
    idx = list(model.graph.node).index(gather)
    model.graph.node.remove(gather)
    for j, node in enumerate(nodes):
        model.graph.node.insert(idx + j, node)
    for node in model.graph.node:
        for j, name in enumerate(node.input):
            if name == old:
                node.input[j] = out
    for vi in model.graph.output:
        if vi.name == old:  # not in pagedkit's graphs; kept correct anyway
            vi.name = out
    for vi in list(model.graph.value_info):
        if vi.name == old:
            model.graph.value_info.remove(vi)
    if not _consumers(model, EMBED_TABLE):
        model.graph.initializer.remove(_init(model, EMBED_TABLE))
