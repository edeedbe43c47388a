"""Mixture-of-experts blocks shared by the families: every routed expert layer is one com.microsoft::MoE node
that computes only the chosen experts (onnxruntime's attribute semantics; pagedkit's runtime runs it on CPU and
CUDA, stock onnxruntime on CPU).

Routing the node expresses natively (`softmax_moe`): softmax over all experts' router logits, top-k, optionally
renormalized (normalize_routing_weights) — Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, GPT-OSS, DeepSeek-V2
greedy — and PhiMoE's sparsemixer (use_sparse_mixer=1).

Routing it cannot express (sigmoid scores with a correction bias and grouped top-k: DeepSeek-V3, GLM-4-MoE, in
`sigmoid_group_route`; DeepSeek-V2's group-limited softmax, `softmax_group_route`; routing weights that are not
the softmax of the logits) is computed by the family in standard ops as the k
chosen experts `idx` [T, k] and their weights `w` [T, k] (float32); `routed_moe` then feeds the node router
logits log(w) at the chosen experts and -inf elsewhere: softmax gives w / sum(w) on exactly those experts, and
the node's output is multiplied by sum(w) afterwards (the experts' outputs are combined linearly), so the
result is sum_j w_j expert_{idx_j}(x) exactly (up to the logits' rounding to the activation type).

Llama 4 applies its router weight to the expert *input*: `input_scaled_moe` scales x per token by the weight
of its single chosen expert and routes it with weight 1 (k = 1 only).

Expert weights arrive in Hugging Face's layout: gate / up [E, I, H] (rows: output features), down [E, H, I];
fc1 is written interleaved [g0, u0, g1, u1, ...] (swiglu_fusion=1) for gated experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onnx import TensorProto

from .graph import MS_DOMAIN, GraphBuilder, cast, gated_mlp, linear

F32, I64 = TensorProto.FLOAT, TensorProto.INT64

# Hugging Face activation -> MoE activation_type for gated experts (act(gate) * up)
_GATED = {"silu": "swiglu", "swish": "swiglu"}
# ... and for plain experts (act(fc1 x))
_PLAIN = {"relu": "relu", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu", "silu": "silu", "swish": "silu",
          "relu2": "relu2"}


@dataclass
class Experts:
    """Routed experts in Hugging Face's layout. gate None: plain experts act(up x)."""

    up: torch.Tensor  # [E, I, H]
    down: torch.Tensor  # [E, H, I]
    gate: torch.Tensor | None = None  # [E, I, H]
    act: str = "silu"
    up_bias: torch.Tensor | None = None  # [E, I]
    gate_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None  # [E, H]

    @classmethod
    def fused(cls, gate_up: torch.Tensor, down: torch.Tensor, act: str, **biases) -> "Experts":
        """From a [E, 2I, H] gate_up tensor whose rows are [gate | up] (transformers' fused experts)."""
        gate, up = gate_up.detach().chunk(2, dim=1)
        return cls(up=up, down=down.detach(), gate=gate, act=act, **biases)

    @property
    def count(self) -> int:
        return int(self.up.shape[0])


def _fc1(ex: Experts) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """fc1 weights [E, fusion * I, H], bias, and the node's activation attributes."""
    if ex.gate is None:
        act = _PLAIN.get(ex.act)
        if act is None:
            raise NotImplementedError(f"MoE expert activation {ex.act!r} has no com.microsoft::MoE activation_type")
        return ex.up.detach(), ex.up_bias, dict(activation_type=act)
    if ex.act not in _GATED:
        raise NotImplementedError(f"gated MoE experts with activation {ex.act!r}: com.microsoft::MoE gates with "
                                  "SiLU (swiglu) only")
    e, i, h = ex.up.shape
    w = torch.stack([ex.gate.detach(), ex.up.detach()], dim=2).reshape(e, 2 * i, h)  # interleaved rows
    b = None
    if ex.up_bias is not None or ex.gate_bias is not None:
        gb = ex.gate_bias if ex.gate_bias is not None else torch.zeros(e, i)
        ub = ex.up_bias if ex.up_bias is not None else torch.zeros(e, i)
        b = torch.stack([gb.detach(), ub.detach()], dim=2).reshape(e, 2 * i)
    return w, b, dict(activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0)


def moe_node(g: GraphBuilder, x: str, logits: str, ex: Experts, k: int, p: str, ip: str, *, normalize: bool,
             sparse_mixer: bool = False) -> str:
    """One com.microsoft::MoE node: x [T, H] routed by `logits` [T, E] (softmax, top-k, renormalized when
    `normalize`; PhiMoE's sparsemixer when `sparse_mixer`). Returns [T, H] in the graph's float type."""
    x = cast(g, x, g.float_type, f"{p}/input/Cast")
    logits = cast(g, logits, g.float_type, f"{p}/router/Cast")
    w1, b1, attrs = _fc1(ex)
    ins = [x, logits, g.initializer(f"{ip}.experts.fc1.weight", w1),
           g.initializer(f"{ip}.experts.fc1.bias", b1.detach()) if b1 is not None else "",
           g.initializer(f"{ip}.experts.fc2.weight", ex.down.detach())]
    if ex.down_bias is not None:
        ins.append(g.initializer(f"{ip}.experts.fc2.bias", ex.down_bias.detach()))
    return g.node("MoE", ins, f"{p}/MoE", domain=MS_DOMAIN, k=int(k), normalize_routing_weights=int(normalize),
                  use_sparse_mixer=int(sparse_mixer), **attrs, out_type=g.float_type, out_shape=g.shape_of(x))


def router_logits(g: GraphBuilder, x: str, weight: torch.Tensor, bias: torch.Tensor | None, p: str, ip: str, *,
                  float32: bool = True) -> str:
    """[T, E] router logits x @ W^T (+ b): in float32 (float32 weight and input, as Hugging Face's routers that
    upcast) or in the graph's float type."""
    if not float32:
        return linear(g, x, weight, bias, f"{p}/router", f"{ip}.router")
    w = g.initializer(f"{ip}.router.MatMul.weight", weight.detach().float().t(), F32)
    y = g.node("MatMul", [cast(g, x, F32, f"{p}/router/input/Cast"), w], f"{p}/router/MatMul", out_type=F32,
               out_shape=(g.shape_of(x)[0], weight.shape[0]))
    if bias is not None:
        y = g.node("Add", [y, g.initializer(f"{ip}.router.Add.bias", bias.detach().float(), F32)], f"{p}/router/Add",
                   out_type=F32, out_shape=g.vi[y][1])
    return y


def softmax_moe(g: GraphBuilder, x: str, logits: str, ex: Experts, k: int, p: str, ip: str, *, normalize: bool,
                scale: float = 1.0, sparse_mixer: bool = False) -> str:
    """Softmax-routed experts (optionally renormalized over the top-k, times `scale`)."""
    y = moe_node(g, x, logits, ex, k, p, ip, normalize=normalize, sparse_mixer=sparse_mixer)
    if scale != 1.0:
        y = g.node("Mul", [y, g.const(float(scale), g.float_type)], f"{p}/MoE/Mul", out_type=g.float_type,
                   out_shape=g.shape_of(y))
    return y


def routed_moe(g: GraphBuilder, x: str, idx: str, w: str, ex: Experts, p: str, ip: str, *,
               weights_sum_to_one: bool = False) -> str:
    """Experts chosen by the family: idx [T, k] int64, w [T, k] float32 (any non-negative weights). The node gets
    logits log(w) at idx and -inf elsewhere, then its output is multiplied by sum(w) (skipped when the family
    guarantees the weights sum to 1)."""
    rows, k = g.shape_of(idx)
    n_exp = ex.count
    te = (rows, n_exp)
    logw = g.node("Log", [w], f"{p}/route/Log", out_type=F32, out_shape=(rows, k))
    shape = g.node("Concat", [g.node("Slice", [g.node("Shape", [idx], f"{p}/route/Shape", out_type=I64,
                                                      out_shape=(2,)), g.const([0], I64), g.const([1], I64)],
                                     f"{p}/route/Slice", out_type=I64, out_shape=(1,)), g.const([n_exp], I64)],
                   f"{p}/route/Concat", axis=0, out_type=I64, out_shape=(2,))
    fill = g.node("ConstantOfShape", [shape], f"{p}/route/ConstantOfShape",
                  value=_scalar(float("-inf")), out_type=F32, out_shape=te)
    logits = g.node("ScatterElements", [fill, idx, logw], f"{p}/route/ScatterElements", axis=1, out_type=F32,
                    out_shape=te)
    y = moe_node(g, x, logits, ex, k, p, ip, normalize=False)
    if weights_sum_to_one:
        return y
    total = g.node("ReduceSum", [w, g.const([-1], I64)], f"{p}/route/ReduceSum", keepdims=1, out_type=F32,
                   out_shape=(rows, 1))
    total = cast(g, total, g.float_type, f"{p}/route/ReduceSum/Cast")
    return g.node("Mul", [y, total], f"{p}/route/Mul", out_type=g.float_type, out_shape=g.shape_of(y))


def input_scaled_moe(g: GraphBuilder, x: str, idx: str, w: str, ex: Experts, p: str, ip: str) -> str:
    """Llama 4: one expert per token (idx [T, 1]) applied to x * w (w [T, 1] float32), routed with weight 1."""
    rows, k = g.shape_of(idx)
    if k != 1:
        raise NotImplementedError(f"router weights applied to the expert input need one expert per token, got k={k}")
    xs = g.node("Mul", [cast(g, x, F32, f"{p}/scale/Cast"), w], f"{p}/scale/Mul", out_type=F32,
                out_shape=g.shape_of(x))
    ones = g.node("ConstantOfShape", [g.node("Shape", [w], f"{p}/scale/Shape", out_type=I64, out_shape=(2,))],
                  f"{p}/scale/ConstantOfShape", value=_scalar(1.0), out_type=F32, out_shape=(rows, 1))
    return routed_moe(g, xs, idx, ones, ex, p, ip, weights_sum_to_one=True)


def shared_expert(g: GraphBuilder, x: str, mlp, act: str, layer: int, *, gate: torch.nn.Linear | None = None,
                  name: str = "shared_expert") -> str:
    """A dense gated MLP beside the routed experts (gate_proj / up_proj / down_proj), optionally scaled per
    token by sigmoid(gate(x)) (Qwen2-MoE's shared_expert_gate)."""
    def wb(lin):
        return lin.weight, lin.bias

    y = gated_mlp(g, x, wb(mlp.gate_proj), wb(mlp.up_proj), wb(mlp.down_proj), act, layer,
                  prefix=f"/model/layers.{layer}/mlp/{name}", init_prefix=f"model.layers.{layer}.mlp.{name}")
    if gate is None:
        return y
    p, ip = f"/model/layers.{layer}/mlp/{name}_gate", f"model.layers.{layer}.mlp.{name}_gate"
    s = linear(g, x, gate.weight, gate.bias, p, ip)
    s = g.node("Sigmoid", [s], f"{p}/Sigmoid", out_type=g.float_type, out_shape=g.shape_of(s))
    return g.node("Mul", [y, s], f"{p}/Mul", out_type=g.float_type, out_shape=g.shape_of(y))


def add(g: GraphBuilder, a: str, b: str, name: str) -> str:
    return g.node("Add", [a, b], name, out_type=g.float_type, out_shape=g.shape_of(a))


def top_k(g: GraphBuilder, scores: str, k: int, p: str) -> tuple[str, str]:
    """(values, int64 indices) [T, k] of the k largest scores along the last axis."""
    rows = g.shape_of(scores)[0]
    outs = [f"{p}/TopK/output_0", f"{p}/TopK/output_1"]
    g.node("TopK", [scores, g.const([k], I64)], f"{p}/TopK", outputs=outs, axis=-1, largest=1, sorted=1)
    g.vi[outs[0]], g.vi[outs[1]] = (g.vi[scores][0], (rows, k)), (I64, (rows, k))
    return outs[0], outs[1]


# ---- DeepSeek-style routing in standard ops (float32), for `routed_moe` ------------------------------------

def sigmoid_group_route(g: GraphBuilder, logits: str, bias: torch.Tensor, k: int, n_group: int, topk_group: int, *,
                        norm: bool, scale: float, p: str, ip: str) -> tuple[str, str]:
    """DeepSeek-V3 / GLM-4-MoE (noaux_tc) on router logits [T, E] float32: scores = sigmoid(logits); the choice
    scores + e_score_correction_bias [E]; groups (n_group of E / n_group experts) ranked by the sum of their top-2
    choice scores, the experts outside the topk_group best set to -inf; the top-k of the choice; weights = the
    scores (not the choice) of the chosen experts, divided by their sum + 1e-20 when `norm`, times `scale`.
    Returns (idx [T, k] int64, w [T, k] float32)."""
    rows, n_exp = g.shape_of(logits)
    te = (rows, n_exp)
    scores = g.node("Sigmoid", [logits], f"{p}/gate/Sigmoid", out_type=F32, out_shape=te)
    b = g.initializer(f"{ip}.gate.e_score_correction_bias", bias.detach().float(), F32)
    choice = g.node("Add", [scores, b], f"{p}/gate/bias/Add", out_type=F32, out_shape=te)
    choice = group_limit(g, choice, n_group, topk_group, top2=True, p=p)
    return _chosen(g, scores, choice, k, norm=norm, scale=scale, p=p)


def softmax_group_route(g: GraphBuilder, logits: str, k: int, n_group: int | None, topk_group: int | None, *,
                        scale: float, p: str) -> tuple[str, str]:
    """DeepSeek-V2 on router logits [T, E] float32: scores = softmax(logits); with n_group (group_limited_greedy)
    groups ranked by their best score, the experts outside the topk_group best set to 0; top-k of the (masked)
    scores, weights = those scores times `scale`, not renormalized. Returns (idx [T, k] int64, w [T, k] float32)."""
    rows, n_exp = g.shape_of(logits)
    scores = g.node("Softmax", [logits], f"{p}/gate/Softmax", axis=-1, out_type=F32, out_shape=(rows, n_exp))
    if n_group is not None:
        scores = group_limit(g, scores, n_group, topk_group, top2=False, p=p)
    return _chosen(g, scores, scores, k, norm=False, scale=scale, p=p)


def group_limit(g: GraphBuilder, choice: str, n_group: int, topk_group: int, *, top2: bool, p: str) -> str:
    """choice [T, E] with the experts outside each token's topk_group best groups masked: top2 (V3) ranks a group
    by the sum of its top-2 scores and masks with -inf, else (V2) by its max score, masking with 0."""
    rows, n_exp = g.shape_of(choice)
    if n_exp % n_group:
        raise NotImplementedError(f"{n_exp} routed experts is not a multiple of n_group {n_group}")
    per = n_exp // n_group
    grouped = g.node("Reshape", [choice, g.const([-1, n_group, per], I64)], f"{p}/gate/group/Reshape", out_type=F32,
                     out_shape=(rows, n_group, per))
    tg = (rows, n_group)
    if top2:
        top, _ = _topk(g, grouped, 2, f"{p}/gate/group/TopK", (rows, n_group, 2))
        gs = g.node("ReduceSum", [top, g.const([-1], I64)], f"{p}/gate/group/ReduceSum", keepdims=0, out_type=F32,
                    out_shape=tg)
    else:
        gs = g.node("ReduceMax", [grouped, g.const([-1], I64)], f"{p}/gate/group/ReduceMax", keepdims=0,
                    out_type=F32, out_shape=tg)
    _, gidx = _topk(g, gs, topk_group, f"{p}/gate/group/TopK_1", (rows, topk_group))
    onehot = g.node("OneHot", [gidx, g.const([n_group], I64), g.const([0.0, 1.0], F32)], f"{p}/gate/group/OneHot",
                    axis=-1, out_type=F32, out_shape=(rows, topk_group, n_group))
    keep = g.node("ReduceMax", [onehot, g.const([1], I64)], f"{p}/gate/group/ReduceMax_1", keepdims=0, out_type=F32,
                  out_shape=tg)
    keep = g.node("Unsqueeze", [keep, g.const([-1], I64)], f"{p}/gate/group/Unsqueeze", out_type=F32,
                  out_shape=(rows, n_group, 1))
    keep = g.node("Cast", [keep], f"{p}/gate/group/Cast", to=TensorProto.BOOL, out_type=TensorProto.BOOL,
                  out_shape=(rows, n_group, 1))
    fill = g.const(float("-inf") if top2 else 0.0, F32)
    masked = g.node("Where", [keep, grouped, fill], f"{p}/gate/group/Where", out_type=F32,
                    out_shape=(rows, n_group, per))
    return g.node("Reshape", [masked, g.const([-1, n_exp], I64)], f"{p}/gate/group/Reshape_1", out_type=F32,
                  out_shape=(rows, n_exp))


def _chosen(g: GraphBuilder, scores: str, choice: str, k: int, *, norm: bool, scale: float, p: str
            ) -> tuple[str, str]:
    """(idx, w): the top-k of `choice` [T, E], weights gathered from `scores`, optionally renormalized, scaled."""
    rows = g.shape_of(scores)[0]
    tk = (rows, k)
    _, idx = _topk(g, choice, k, f"{p}/gate/TopK", tk)
    w = g.node("GatherElements", [scores, idx], f"{p}/gate/GatherElements", axis=1, out_type=F32, out_shape=tk)
    if norm:
        s = g.node("ReduceSum", [w, g.const([-1], I64)], f"{p}/gate/ReduceSum", keepdims=1, out_type=F32,
                   out_shape=(rows, 1))
        s = g.node("Add", [s, g.const(1e-20, F32)], f"{p}/gate/eps/Add", out_type=F32, out_shape=(rows, 1))
        w = g.node("Div", [w, s], f"{p}/gate/Div", out_type=F32, out_shape=tk)
    w = g.node("Mul", [w, g.const(float(scale), F32)], f"{p}/gate/scale/Mul", out_type=F32, out_shape=tk)
    return idx, w


def _topk(g: GraphBuilder, x: str, k: int, name: str, out_shape: tuple) -> tuple[str, str]:
    """TopK along the last axis of x (any rank): (values, int64 indices) of shape `out_shape`."""
    outs = [f"{name}/output_0", f"{name}/output_1"]
    g.node("TopK", [x, g.const([k], I64)], name, outputs=outs, axis=-1, largest=1, sorted=1)
    g.vi[outs[0]], g.vi[outs[1]] = (g.vi[x][0], out_shape), (I64, out_shape)
    return outs[0], outs[1]


def _scalar(value: float):
    import onnx

    return onnx.helper.make_tensor("value", F32, [1], [value])


__all__ = ["Experts", "add", "group_limit", "input_scaled_moe", "moe_node", "routed_moe", "router_logits",
           "shared_expert", "sigmoid_group_route", "softmax_group_route", "softmax_moe", "top_k"]
