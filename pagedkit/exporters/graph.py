"""Small graph-building helpers shared by every exporter family.

`GraphBuilder` collects nodes, initializers, graph inputs/outputs and the known type/shape of every
tensor it makes (handed to the PagedAttention node builder, which validates the node against the
contract). The helpers build the pieces every decoder has: linear layers (`[T, in] @ [in, out]`),
RMSNorm (ONNX `RMSNormalization`, opset 23) and the residual stream with onnxruntime's fused
`SkipSimplifiedLayerNormalization`, activations, the gated MLP, rotary cos/sin caches computed by the
model's own Hugging Face rotary-embedding module (the attention node itself: attention.py).

Tensor names follow onnxruntime-genai's builder: node `/model/layers.{i}/attn/qkv_proj/MatMul`,
its output `/model/layers.{i}/attn/qkv_proj/MatMul/output_0`, initializer
`model.layers.{i}.attn.qkv_proj.MatMul.weight`.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx
import torch

from ..interface import dtypes
from .lazy import materialize

ONNX_OPSET = 23  # RMSNormalization
MS_DOMAIN = "com.microsoft"

Shape = tuple  # of int | str


def tensor_proto(name: str, value: torch.Tensor | np.ndarray, elem_type: int) -> onnx.TensorProto:
    """An initializer of `elem_type` from a torch tensor / numpy array / LazyTensor (evaluated here; bf16 and
    fp8 included, raw bytes)."""
    t = torch.as_tensor(materialize(value)).detach().to("cpu")
    t = t.to(dtypes.torch_dtype(elem_type)).contiguous()
    proto = onnx.TensorProto()
    proto.name = name
    proto.data_type = elem_type
    proto.dims.extend(t.shape)
    proto.raw_data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return proto


@dataclass
class Pending:
    """An initializer not yet written: its value (a tensor, or a LazyTensor evaluated when written)."""

    name: str
    value: Any
    elem_type: int

    def proto(self) -> onnx.TensorProto:
        return tensor_proto(self.name, self.value, self.elem_type)


class GraphBuilder:
    """Collects one ONNX graph. `vi` maps every tensor name to (elem_type, shape) where known. Initializers are
    kept as `Pending` values (a family's weight transforms stay lazy, lazy.py) and written by `model()`."""

    def __init__(self, float_type: int, attn_type: int | None = None):
        self.float_type = float_type  # the activation / weight type of the graph (fp16 / bf16 / float32)
        # PagedAttention's T (float16 / bfloat16 only, contract-decisions §6): the float_type itself, or for a
        # float32 graph the type its attention nodes run in (Casts around each node, `paged_attention`)
        self.attn_type = float_type if attn_type is None else attn_type
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[Pending] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.vi: dict[str, tuple[int, Shape]] = {}
        self._consts: dict[tuple, str] = {}

    # ---- tensors -------------------------------------------------------------------------------
    def initializer(self, name: str, value, elem_type: int | None = None) -> str:
        if name in self.vi:
            raise ValueError(f"tensor name {name!r} defined twice")
        elem_type = self.float_type if elem_type is None else elem_type
        if not isinstance(value, torch.Tensor):  # numpy arrays, lists: small constants
            value = torch.as_tensor(np.asarray(value))
        self.initializers.append(Pending(name, value.detach(), elem_type))
        self.vi[name] = (elem_type, tuple(int(d) for d in value.shape))
        return name

    def const(self, values: Sequence[float | int] | float | int, elem_type: int) -> str:
        """A small shared constant initializer (shape [] for a scalar)."""
        arr = np.asarray(values)
        key = (elem_type, arr.shape, tuple(arr.reshape(-1).tolist()))
        if key not in self._consts:
            name = f"/model/constants/{onnx.TensorProto.DataType.Name(elem_type)}/{arr.reshape(-1).tolist()}"
            if name in self.vi:  # the same values in another shape (a scalar 0 and [0])
                name += f"/shape{list(arr.shape)}"
            self._consts[key] = self.initializer(name, torch.as_tensor(arr), elem_type)
        return self._consts[key]

    def input(self, name: str, elem_type: int, shape: Shape) -> str:
        self.inputs.append(onnx.helper.make_tensor_value_info(name, elem_type, list(shape)))
        self.vi[name] = (elem_type, tuple(shape))
        return name

    def output(self, name: str, elem_type: int, shape: Shape) -> str:
        self.outputs.append(onnx.helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    # ---- nodes ---------------------------------------------------------------------------------
    def node(self, op_type: str, inputs: Sequence[str], name: str, *, domain: str = "",
             outputs: Sequence[str] | None = None, out_type: int | None = None, out_shape: Shape | None = None,
             **attrs: Any) -> str:
        """Add a node; returns its first output (named `{name}/output_0` unless `outputs` is given)."""
        outputs = list(outputs) if outputs is not None else [f"{name}/output_0"]
        self.nodes.append(onnx.helper.make_node(op_type, list(inputs), outputs, name=name, domain=domain, **attrs))
        if out_type is not None:
            self.vi[outputs[0]] = (out_type, tuple(out_shape) if out_shape is not None else None)
        return outputs[0]

    def add(self, node: onnx.NodeProto) -> None:
        self.nodes.append(node)

    def retyped(self, name: str, elem_type: int) -> str:
        """Initializer `name` as `elem_type`: itself when it has that type, else a converted copy
        (`{name}/{TYPE}`, made once)."""
        if self.vi[name][0] == elem_type:
            return name
        new = f"{name}/{onnx.TensorProto.DataType.Name(elem_type)}"
        if new not in self.vi:
            src = next(t for t in self.initializers if t.name == name)
            self.initializer(new, src.value, elem_type)  # converted to elem_type when written
        return new

    def is_initializer(self, name: str) -> bool:
        return any(t.name == name for t in self.initializers)

    def shape_of(self, name: str) -> Shape:
        return self.vi[name][1]

    def nbytes(self) -> int:
        """Bytes of the pending initializers once written."""
        return sum(math.prod(self.vi[p.name][1]) * dtypes.numpy_dtype(p.elem_type).itemsize for p in self.initializers)

    def model(self, name: str, producer: str, doc: str = "", external: Path | None = None,
              threshold: int = 1024, max_shard_bytes: int | None = None) -> onnx.ModelProto:
        """The ModelProto. Initializers are evaluated and move into it one at a time (the builder's list is
        emptied), so a large model is never held twice (onnx.helper.make_graph / make_model would copy every
        weight). With `external` (a file path), each initializer of >= threshold bytes is written there as it is
        evaluated — a large lazy one in row chunks (external.py) — and the proto keeps only its location: the
        weights are never all in memory. max_shard_bytes: start a new data file (`external`.1, .2, ...) rather
        than grow one past this size."""
        from . import slicing
        from .external import ExternalData

        model = onnx.ModelProto()
        model.ir_version = 10
        model.producer_name = producer
        model.doc_string = doc
        model.opset_import.extend([onnx.helper.make_opsetid("", ONNX_OPSET), onnx.helper.make_opsetid(MS_DOMAIN, 1)])
        graph = model.graph
        graph.name = name
        graph.node.extend(self.nodes)
        graph.input.extend(self.inputs)
        graph.output.extend(self.outputs)
        self.initializers.reverse()
        sink = ExternalData(Path(external), max_shard_bytes) if external is not None else None
        try:
            while self.initializers:
                p = self.initializers.pop()
                size = math.prod(self.vi[p.name][1]) * dtypes.numpy_dtype(p.elem_type).itemsize
                if sink is not None and size >= threshold:
                    graph.initializer.append(sink.write(p.name, p.value, p.elem_type))
                else:
                    graph.initializer.append(p.proto())
                    slicing.clear()
        finally:
            if sink is not None:
                sink.close()
        return model


# ---- building blocks ---------------------------------------------------------------------------------

def linear(g: GraphBuilder, x: str, weight: torch.Tensor, bias: torch.Tensor | None, prefix: str,
           init_prefix: str) -> str:
    """y[T, out] = x[T, in] @ W^T (+ b); `weight` is torch's [out, in] (stored transposed, [in, out])."""
    from . import prequant

    x = cast(g, x, g.float_type, f"{prefix}/input/Cast")  # e.g. from a float32 residual stream
    rows = g.shape_of(x)[0]
    out_features = weight.shape[0]
    int4 = prequant.int4_rows(weight)  # rows of a GPTQ / AWQ checkpoint: MatMulNBits over its own codes
    if int4 is not None:
        packed = prequant.Packed(int4, dtypes.torch_dtype(g.float_type))
        y = prequant.matmul_nbits(g, x, packed, prefix, init_prefix, rows)
    else:
        w = g.initializer(f"{init_prefix}.MatMul.weight", weight.detach().t())
        y = g.node("MatMul", [x, w], f"{prefix}/MatMul", out_type=g.float_type, out_shape=(rows, out_features))
    if bias is not None:
        b = g.initializer(f"{init_prefix}.Add.bias", bias.detach())
        y = g.node("Add", [y, b], f"{prefix}/Add", out_type=g.float_type, out_shape=(rows, out_features))
    return y


def cast(g: GraphBuilder, x: str, to: int, name: str) -> str:
    if g.vi[x][0] == to:
        return x
    return g.node("Cast", [x], name, to=to, out_type=to, out_shape=g.shape_of(x))


def rms_norm(g: GraphBuilder, x: str, weight: torch.Tensor, eps: float, prefix: str, init_name: str) -> str:
    """RMSNorm over the last axis, computed in float32 (stash_type=1), weight of x's type."""
    elem_type, shape = g.vi[x]
    w = g.initializer(init_name, weight.detach(), elem_type)
    return g.node("RMSNormalization", [x, w], f"{prefix}/RMSNormalization", axis=-1, epsilon=float(eps),
                  stash_type=1, out_type=elem_type, out_shape=shape)


def layer_norm(g: GraphBuilder, x: str, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, prefix: str,
               init_name: str) -> str:
    """LayerNorm (mean-centred) over the last axis in float32 (stash_type=1); weight / bias of x's type.
    `init_name` names the weight; the bias is `init_name` with `weight` -> `bias`."""
    elem_type, shape = g.vi[x]
    ins = [x, g.initializer(init_name, weight.detach(), elem_type)]
    if bias is not None:
        ins.append(g.initializer(_bias_name(init_name), bias.detach(), elem_type))
    return g.node("LayerNormalization", ins, f"{prefix}/LayerNormalization", axis=-1, epsilon=float(eps),
                  stash_type=1, out_type=elem_type, out_shape=shape)


def _bias_name(weight_name: str) -> str:
    return weight_name[:-len("weight")] + "bias" if weight_name.endswith("weight") else weight_name + ".bias"


@dataclass
class Norm:
    """One norm of the model: RMSNorm (`kind` "rms") or LayerNorm ("layer", optional bias), gains already in
    their multiplicative form (Gemma's 1 + w, Nemotron's LayerNorm1P)."""

    weight: torch.Tensor
    eps: float
    kind: str = "rms"
    bias: torch.Tensor | None = None

    def apply(self, g: GraphBuilder, x: str, prefix: str, init_name: str) -> str:
        if self.kind == "rms":
            return rms_norm(g, x, self.weight, self.eps, prefix, init_name)
        return layer_norm(g, x, self.weight, self.bias, self.eps, prefix, init_name)


class Residual:
    """The residual stream h with a pending sublayer output: `norm()` fuses "h += pending; RMSNorm(h)"
    into one SkipSimplifiedLayerNormalization (onnxruntime contrib op, as onnxruntime-genai does)."""

    def __init__(self, g: GraphBuilder, h: str):
        self.g, self.h, self.pending = g, h, None

    @property
    def elem_type(self) -> int:
        return self.g.vi[self.h][0]

    def add(self, delta: str, prefix: str) -> None:
        delta = cast(self.g, delta, self.elem_type, f"{prefix}/residual/Cast")
        if self.pending is not None:
            self.flush(prefix)
        self.pending = delta

    def flush(self, prefix: str) -> str:
        if self.pending is not None:
            self.h = self.g.node("Add", [self.h, self.pending], f"{prefix}/residual/Add",
                                 out_type=self.elem_type, out_shape=self.g.shape_of(self.h))
            self.pending = None
        return self.h

    def norm(self, weight: "torch.Tensor | Norm", eps: float | None, prefix: str, init_name: str) -> str:
        """h += pending; return norm(h). `weight` is an RMSNorm gain (with `eps`) or a `Norm` (eps None):
        LayerNorms fuse into SkipLayerNormalization, RMSNorms into SkipSimplifiedLayerNormalization."""
        g = self.g
        norm = weight if isinstance(weight, Norm) else Norm(weight, float(eps))
        if self.pending is None:
            return norm.apply(g, self.h, prefix, init_name)
        ins = [self.pending, self.h, g.initializer(init_name, norm.weight.detach(), self.elem_type)]
        op = "SkipSimplifiedLayerNormalization"
        if norm.kind == "layer":
            op = "SkipLayerNormalization"
            if norm.bias is not None:
                ins.append(g.initializer(_bias_name(init_name), norm.bias.detach(), self.elem_type))
        name = f"{prefix}/SkipLayerNorm"
        outs = [f"{name}/output_0", "", "", f"{name}/output_3"]
        g.node(op, ins, name, domain=MS_DOMAIN, outputs=outs, epsilon=float(norm.eps))
        shape = g.shape_of(self.h)
        g.vi[outs[0]] = g.vi[outs[3]] = (self.elem_type, shape)
        self.h, self.pending = outs[3], None
        return outs[0]


def activation(g: GraphBuilder, x: str, act: str, prefix: str) -> str:
    """Hugging Face ACT2FN names -> ONNX ops."""
    t, shape = g.vi[x]
    if act in ("silu", "swish"):
        s = g.node("Sigmoid", [x], f"{prefix}/Sigmoid", out_type=t, out_shape=shape)
        return g.node("Mul", [x, s], f"{prefix}/Mul", out_type=t, out_shape=shape)
    if act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        return g.node("Gelu", [x], f"{prefix}/Gelu", approximate="tanh", out_type=t, out_shape=shape)
    if act == "gelu":
        return g.node("Gelu", [x], f"{prefix}/Gelu", out_type=t, out_shape=shape)
    if act == "relu":
        return g.node("Relu", [x], f"{prefix}/Relu", out_type=t, out_shape=shape)
    if act == "relu2":  # squared ReLU (Nemotron)
        r = g.node("Relu", [x], f"{prefix}/Relu", out_type=t, out_shape=shape)
        return g.node("Mul", [r, r], f"{prefix}/Mul", out_type=t, out_shape=shape)
    raise NotImplementedError(f"hidden activation {act!r} is not supported "
                              "(silu, gelu, gelu_pytorch_tanh, gelu_new, relu, relu2)")


def gated_mlp(g: GraphBuilder, x: str, gate: tuple, up: tuple, down: tuple, act: str, layer: int, *,
              prefix: str | None = None, init_prefix: str | None = None) -> str:
    """down(act(gate(x)) * up(x)); gate/up/down are (weight [out, in], bias or None). Named under
    `/model/layers.{layer}/mlp` unless prefix / init_prefix say otherwise (a shared expert)."""
    p = prefix or f"/model/layers.{layer}/mlp"
    ip = init_prefix or f"model.layers.{layer}.mlp"
    a = linear(g, x, *gate, f"{p}/gate_proj", f"{ip}.gate_proj")
    b = linear(g, x, *up, f"{p}/up_proj", f"{ip}.up_proj")
    a = activation(g, a, act, f"{p}/act_fn")
    m = g.node("Mul", [a, b], f"{p}/Mul", out_type=g.float_type, out_shape=g.shape_of(b))
    return linear(g, m, *down, f"{p}/down_proj", f"{ip}.down_proj")


def plain_mlp(g: GraphBuilder, x: str, up: tuple, down: tuple, act: str, layer: int) -> str:
    """down(act(up(x))) (no gate: StarCoder2, Nemotron, Phi-2); up/down are (weight [out, in], bias or None)."""
    p, ip = f"/model/layers.{layer}/mlp", f"model.layers.{layer}.mlp"
    a = activation(g, linear(g, x, *up, f"{p}/up_proj", f"{ip}.up_proj"), act, f"{p}/act_fn")
    return linear(g, a, *down, f"{p}/down_proj", f"{ip}.down_proj")


def scale(g: GraphBuilder, x: str, factor: float, name: str) -> str:
    """x * factor (a no-op for 1.0), in x's type."""
    if float(factor) == 1.0:
        return x
    t, shape = g.vi[x]
    return g.node("Mul", [x, g.const(float(factor), t)], name, out_type=t, out_shape=shape)


# ---- rotary ------------------------------------------------------------------------------------------

@torch.no_grad()
def rotary_tables(rotary_emb: torch.nn.Module, max_positions: int, layer_type: str | None = None,
                  duplicated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin caches [max_positions, rotary_dim / 2] (float32) from the model's own rotary module run on
    positions 0..max_positions-1: its scaling (linear, llama3, YaRN incl. the attention factor folded
    into cos/sin, ...) is exactly what the model computes. duplicated: the module returns the
    rotate_half form [freqs, freqs] (most models); False: it returns [freqs] only (GPT-OSS)."""
    # a fresh float32 module: a model loaded in fp16/bf16 may hold its inverse frequencies rounded
    rotary_emb = type(rotary_emb)(config=rotary_emb.config)
    pos = torch.arange(max_positions, dtype=torch.int64)[None, :]
    probe = torch.zeros(1, dtype=torch.float32)
    params = inspect.signature(rotary_emb.forward).parameters
    if "layer_type" in params:
        cos, sin = rotary_emb(probe, pos, layer_type=layer_type)
    else:
        cos, sin = rotary_emb(probe, pos)
    cos, sin = cos[0].float(), sin[0].float()  # [P, rotary_dim] (halves repeated) or [P, rotary_dim / 2]
    if not duplicated:
        return cos.contiguous(), sin.contiguous()
    half = cos.shape[-1] // 2
    if not torch.equal(cos[:, :half], cos[:, half:]):
        raise NotImplementedError("rotary embedding whose cos table is not [freqs, freqs] (rotate_half form)")
    return cos[:, :half].contiguous(), sin[:, :half].contiguous()
