"""com.microsoft MoE: top-k mixture of experts (Mixtral, GPT-OSS layouts).

Routing, as onnxruntime: softmax over all experts' router logits (float32), top-k, and with
normalize_routing_weights=1 the k weights renormalized to sum 1. Weights are [out, in] per expert:
fc1 [E, fusion * I, hidden], fc2 [E, hidden, I], fc3 [E, I, hidden]. Activations:
  relu, gelu (tanh approximation, as onnxruntime's CPU kernel), silu, identity, relu2,
  swiglu: G = min(g, limit), L = clamp(l, -limit, limit), G * sigmoid(alpha G) * (L + beta)
          (swiglu_limit_after_activation=1 clamps the activated gate instead),
  geglu:  gelu_tanh(g) * l.
swiglu/geglu take g and l from fc1, interleaved (swiglu_fusion=1: [g0, l0, g1, l1, ...]) or
concatenated ([g | l], fusion 2), or (swiglu, fusion 0) g from fc1 and l from fc3. Other activations
with fc3 gate it: act(fc1 x) * (fc3 x).
Matmuls run in the input dtype; activations and the weighted sum of expert outputs in float32.
Small batches (tokens * k <= experts, i.e. decode) gather the chosen experts' weights and stay on
the device; larger ones group tokens by expert, which reads the per-expert counts on the host.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .registry import MS_DOMAIN, register
from .util import opt


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] with w [out, in] (one expert) or w [n, out, in] (one expert per row); b [out] / [n, out]."""
    y = x @ w.T if w.dim() == 2 else torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
    return y + b if b is not None else y


def _activate(h: torch.Tensor, attrs: dict, where: str) -> torch.Tensor:
    act = attrs.get("activation_type", "relu")
    h = h.float()
    if act == "relu":
        return torch.relu(h)
    if act == "relu2":
        return torch.relu(h).square()
    if act == "gelu":
        return F.gelu(h, approximate="tanh")
    if act == "silu":
        return F.silu(h)
    if act == "identity":
        return h
    raise NotImplementedError(f"{where}: activation_type {act!r} is not supported")


def _glu(g: torch.Tensor, l: torch.Tensor, attrs: dict) -> torch.Tensor:
    g, l = g.float(), l.float()
    if attrs.get("activation_type") == "geglu":
        return F.gelu(g, approximate="tanh") * l
    alpha, beta = attrs.get("activation_alpha", 1.0), attrs.get("activation_beta", 0.0)
    limit = attrs.get("swiglu_limit", math.inf)
    l = l.clamp(-limit, limit)
    if attrs.get("swiglu_limit_after_activation", 0):
        return (g * torch.sigmoid(alpha * g)).clamp(max=limit) * (l + beta)
    g = g.clamp(max=limit)
    return g * torch.sigmoid(alpha * g) * (l + beta)


def _experts(x, sel, w, attrs, where):
    """FFN of the experts `sel` (an int for one expert, or [n] indices, one per row) on x [n, hidden]."""
    fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = (t[sel] if t is not None else None for t in w)
    h = _linear(x, fc1_w, fc1_b)
    if attrs.get("activation_type", "relu") in ("swiglu", "geglu"):
        fusion = attrs.get("swiglu_fusion", 0)
        if fusion == 1:
            g, l = h[..., 0::2], h[..., 1::2]
        elif fusion == 2:
            g, l = h.chunk(2, dim=-1)
        elif fc3_w is not None:
            g, l = h, _linear(x, fc3_w, fc3_b)
        else:
            raise ValueError(f"{where}: swiglu_fusion=0 needs fc3_experts_weights")
        a = _glu(g, l, attrs)
    else:
        a = _activate(h, attrs, where)
        if fc3_w is not None:
            a = a * _linear(x, fc3_w, fc3_b).float()
    return _linear(a.to(x.dtype), fc2_w, fc2_b)


@register("MoE", domain=MS_DOMAIN)
def moe(inputs, attrs, ctx):
    x, router = inputs[0], inputs[1]  # x [T, hidden] or [B, S, hidden]; router [T, E] logits
    weights = (inputs[2], opt(inputs, 3), inputs[4], opt(inputs, 5), opt(inputs, 6), opt(inputs, 7))
    where = f"MoE node {ctx.node_name!r}"
    if attrs.get("use_sparse_mixer", 0):
        raise NotImplementedError(f"{where}: use_sparse_mixer=1 is not supported")
    k = attrs.get("k", 1)
    xs = x.reshape(-1, x.shape[-1])  # [T, hidden]
    n_tok, n_exp = xs.shape[0], router.shape[-1]
    probs = torch.softmax(router.reshape(n_tok, n_exp).float(), dim=-1)
    top_w, top_e = torch.topk(probs, k, dim=-1)  # [T, k]
    if attrs.get("normalize_routing_weights", 0):
        top_w = top_w / top_w.sum(-1, keepdim=True)
    rows = torch.arange(n_tok, device=x.device).repeat_interleave(k)  # [T*k] token of each route
    route_e, route_w = top_e.reshape(-1), top_w.reshape(-1)
    if n_tok * k <= n_exp:  # gather the chosen experts' weights: no host read
        y = _experts(xs[rows], route_e, weights, attrs, where).float()
        contrib, dest = y * route_w.unsqueeze(-1), rows
    else:  # group routes by expert
        order = torch.argsort(route_e, stable=True)
        counts = torch.bincount(route_e, minlength=n_exp).tolist()
        dest = rows[order]
        contrib = torch.empty(n_tok * k, xs.shape[-1], dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if c:
                seg = slice(start, start + c)
                contrib[seg] = _experts(xs[dest[seg]], e, weights, attrs, where).float()
                start += c
        contrib = contrib * route_w[order].unsqueeze(-1)
    out = torch.zeros(n_tok, xs.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, dest, contrib)
    return [out.to(x.dtype).reshape(x.shape)]
