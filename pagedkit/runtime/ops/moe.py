"""com.microsoft MoE: top-k mixture of experts (Mixtral, GPT-OSS layouts).

Routing, as onnxruntime: softmax over all experts' router logits (float32), top-k, and with
normalize_routing_weights=1 the k weights renormalized to sum 1. use_sparse_mixer=1 (k = 2 only): PhiMoE's
sparsemixer in eval mode, as onnxruntime's CUDA kernel `sparse_mixer_top2` with its constant jitter_eps 0.01:
expert 1 = argmax s; mask_j = (m1 - s_j) > 2 eps max(|s_j|, m1); w1 = 1 / sum over unmasked j of
exp(s_j - m1); expert 2 = argmax of s without expert 1, the same with m2 and expert 1 masked too; the two
weights are not renormalized (normalize_routing_weights does not apply). onnxruntime's kernel takes 8 or 16
experts; this one any number >= 2. (onnxruntime 1.32's CPU MoE ignores the attribute: softmax top-2.)
Weights are [out, in] per expert: fc1 [E, fusion * I, hidden], fc2 [E, hidden, I], fc3 [E, I, hidden]. Activations:
  relu, gelu (tanh approximation, as onnxruntime's CPU kernel), silu, identity, relu2,
  swiglu: G = min(g, limit), L = clamp(l, -limit, limit), G * sigmoid(alpha G) * (L + beta)
          (swiglu_limit_after_activation=1 clamps the activated gate instead),
  geglu:  gelu_tanh(g) * l.
swiglu/geglu take g and l from fc1, interleaved (swiglu_fusion=1: [g0, l0, g1, l1, ...]) or
concatenated ([g | l], fusion 2), or (swiglu, fusion 0) g from fc1 and l from fc3. Other activations
with fc3 gate it: act(fc1 x) * (fc3 x).
Matmuls run in the input dtype (float32 for half inputs, see _experts); activations and the weighted sum of expert outputs in float32.
On CUDA the experts run as two grouped GEMM launches over the routes sorted by expert (kernels/triton/moe.py:
no host read at any batch, CUDA-graph capturable; its hidden rows in the activation dtype, as onnxruntime's CUDA
MoE) wherever that kernel serves the node (`triton_moe_refusal` says why not). Otherwise small batches (tokens * k
<= experts, i.e. decode) gather the chosen experts' weights and stay on the device; on CUDA, steps of up to
DENSE_MAX_TOKENS tokens with more routes than experts run every expert on every token (no host read); larger ones
group tokens by expert, which reads the per-expert counts on the host. ROUTES[node name] records which of
"triton", "dense", "gather" or "grouped" served a node's last call.

com.microsoft QMoE (quant_type 'int': 2/4/8-bit expert weights [E, N, K * bits / 8] packed along K, low
bits first, scales [E, N, K / block_size] or per row [E, N], zero points packed like the weights, default
2^(bits-1)) dequantizes the experts ((q - zp) * scale in float32, then the scales' dtype) and runs MoE; on CUDA the
fused kernel takes the codes as they are and dequantizes them in its loads, the same way. The
prepack step dequantizes them once, within nbits' dequantized-cache budget; otherwise on every call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ... import settings
from . import nbits
from .quant import unpack_bits
from .registry import MS_DOMAIN, RUNTIME, prepack, register
from .util import opt, triton_kernels

ROUTES: dict[str, str] = {}  # node name -> the path its last call took (module doc)
HOST_ROUTES = ("grouped",)  # the paths that read the host (per-expert counts): a step taking one is not capturable
REFUSED: dict[str, str] = {}  # node name -> why the fused kernel did not serve its last call
# node name -> the experts [T, k] chosen at each call run eagerly, while a caller collects them (paged-bench's floor:
# the experts a decode step touches); None: not collected. Calls inside a CUDA-graph capture are not collected.
ROUTE_LOG: dict[str, list[torch.Tensor]] | None = None
# route with kernels/triton/moe_route.py (softmax, top-k and the grouped GEMMs' plan in one launch) where it and the
# fused expert kernel serve the call; ROUTED_BY[node name]: "kernel" or "torch" for its last call
ROUTE_KERNEL: bool = settings.read("PAGEDKIT_MOE_ROUTE_KERNEL")
ROUTED_BY: dict[str, str] = {}
TRITON_FAILURE: list[str] = []  # why the fused kernel failed on this device, once it has: the torch path since
ROUTE_FAILURE: list[str] = []  # why the routing kernel failed on this device, once it has: torch routes since


def triton_moe_refusal(xs: torch.Tensor, weights, attrs: dict) -> str | None:
    """None when kernels/triton/moe.py serves this call (CUDA tensors), else why not."""
    if not xs.is_cuda:
        return "not a CUDA tensor"
    if TRITON_FAILURE:
        return f"the fused kernel failed here: {TRITON_FAILURE[0]}"
    tk = triton_kernels("moe")
    return "triton is not available" if tk is None else tk.serves(xs, weights, attrs)


def _failed(failures: list[str], exc: Exception, where: str, what: str, fallback: str) -> None:
    """Record (once) and warn that a Triton kernel failed to build or run on this device: `fallback` serves from
    now on."""
    import warnings

    failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    warnings.warn(f"{where}: the {what} failed ({failures[0]}); {fallback} from now on (runtime/ops/moe.py)",
                  RuntimeWarning, stacklevel=3)


def _fused(xs, top_e, top_w, weights, attrs, where: str, plan=None) -> torch.Tensor | None:
    """The fused kernel's output, or None (recorded in TRITON_FAILURE, with a warning) when it fails to build or
    run on this device: the torch path serves this call and every later one."""
    try:
        return triton_kernels("moe").fused_moe(xs.contiguous(), top_e, top_w, weights, attrs, plan=plan)
    except Exception as exc:  # a Triton compile / launch error on this device
        _failed(TRITON_FAILURE, exc, where, "fused MoE kernel", "MoE runs its torch path")
        return None


def _route_kernel(router, k: int, attrs: dict, where: str):
    """(top_e, top_w, plan) from kernels/triton/moe_route.py where it serves (ROUTE_KERNEL on; the fused expert
    kernel serves this call), else None: the op routes with torch. A kernel that fails on this device warns once
    (ROUTE_FAILURE) and torch routes from then on."""
    if not ROUTE_KERNEL or ROUTE_FAILURE:
        return None
    rk = triton_kernels("moe_route")
    if rk is None or rk.serves(router, k, attrs) is not None:
        return None
    try:
        return rk.route_plan(router, k, bool(attrs.get("normalize_routing_weights", 0)),
                             triton_kernels("moe").BLOCK_M)
    except Exception as exc:  # a Triton compile / launch error on this device
        _failed(ROUTE_FAILURE, exc, where, "MoE routing kernel", "torch routes")
        return None


def _route_torch(router, k: int, attrs: dict, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_w [T, k] float32, top_e [T, k]) as onnxruntime routes (module doc): softmax top-k, or sparsemixer."""
    n_exp = router.shape[-1]
    logits = router.reshape(-1, n_exp)
    if attrs.get("use_sparse_mixer", 0):
        if k != 2 or n_exp < 2:
            raise ValueError(f"{where}: use_sparse_mixer=1 routes k=2 of >= 2 experts, got k={k}, {n_exp} experts")
        return sparse_mixer(logits)
    top_w, top_e = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if attrs.get("normalize_routing_weights", 0):
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_w, top_e


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


def _ffn_hidden(x, lin, w, attrs, where):
    """The activated hidden state of an expert FFN: act(fc1 x) (gated by fc3 x), or the GLU of fc1's halves
    (or of fc1 and fc3); lin(x, weight, bias) is the product (one expert, one per row, or every expert)."""
    fc1_w, fc1_b, fc3_w, fc3_b = w
    h = lin(x, fc1_w, fc1_b)
    if attrs.get("activation_type", "relu") in ("swiglu", "geglu"):
        fusion = attrs.get("swiglu_fusion", 0)
        if fusion == 1:
            g, l = h[..., 0::2], h[..., 1::2]
        elif fusion == 2:
            g, l = h.chunk(2, dim=-1)
        elif fc3_w is not None:
            g, l = h, lin(x, fc3_w, fc3_b)
        else:
            raise ValueError(f"{where}: swiglu_fusion=0 needs fc3_experts_weights")
        return _glu(g, l, attrs)
    a = _activate(h, attrs, where)
    if fc3_w is not None:
        a = a * lin(x, fc3_w, fc3_b).float()
    return a


def _experts(x, sel, w, attrs, where):
    """FFN of the experts `sel` (an int for one expert, or [n] indices, one per row) on x [n, hidden].
    Half-precision inputs run in float32 on every device (the selected experts' weights converted per call,
    as onnxruntime's CPU kernel computes in float): rounding h and the activation to half between the two
    products would add an error onnxruntime does not make (and CPU and CUDA would disagree by it); torch's
    half CPU products are slow besides."""
    fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = (t[sel] if t is not None else None for t in w)
    if x.dtype in (torch.float16, torch.bfloat16):
        fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = (t.float() if t is not None else None
                                                    for t in (fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b))
        x = x.float()
    a = _ffn_hidden(x, _linear, (fc1_w, fc1_b, fc3_w, fc3_b), attrs, where)
    return _linear(a.to(x.dtype), fc2_w, fc2_b)


DENSE_MAX_TOKENS = 64  # CUDA steps of at most this many tokens with tokens * k > experts run every expert densely


def _all_experts(xs, w, attrs, where):
    """Every expert's FFN on every token, [E, T, hidden] float32: each expert's weights read once, routing
    applied by the caller, no host read (a CUDA-graph capturable decode step). Same float32 arithmetic as
    _experts (the weights converted per call)."""
    fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = w

    def lin(x, wt, bt):  # x [T, in] or [E, T, in]; wt [E, out, in]; bt [E, out]
        y = torch.matmul(x, wt.float().transpose(1, 2))
        return y + bt.float().unsqueeze(1) if bt is not None else y

    a = _ffn_hidden(xs.float(), lin, (fc1_w, fc1_b, fc3_w, fc3_b), attrs, where)
    return lin(a, fc2_w, fc2_b)


SPARSE_MIXER_EPS = 0.01  # onnxruntime's constant jitter_eps (PhiMoE's router_jitter_noise)


def _mixer_weight(s: torch.Tensor, top: torch.Tensor, excluded: torch.Tensor | None) -> torch.Tensor:
    """[T, 1] sparsemixer weight of the expert holding `top` [T, 1] (its logit): 1 / sum of exp(s_j - top) over
    the experts j not masked (top - s_j > 2 eps max(|s_j|, top), or `excluded` [T, E] bool)."""
    mask = (top - s) > (2 * SPARSE_MIXER_EPS) * torch.maximum(s.abs(), top)
    if excluded is not None:
        mask = mask | excluded
    return 1.0 / torch.exp(s - top).masked_fill(mask, 0.0).sum(-1, keepdim=True)


def sparse_mixer(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """use_sparse_mixer routing of logits [T, E]: (weights [T, 2] float32, experts [T, 2] int64)."""
    s = logits.float()
    m1, e1 = s.max(-1, keepdim=True)  # ties: the lowest index, as the kernel's arg-max
    first = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, e1, True)
    m2, e2 = s.masked_fill(first, -math.inf).max(-1, keepdim=True)
    w = torch.cat([_mixer_weight(s, m1, None), _mixer_weight(s, m2, first)], -1)
    return w, torch.cat([e1, e2], -1)


@register("MoE", domain=MS_DOMAIN)
def moe(inputs, attrs, ctx):
    x, router = inputs[0], inputs[1]  # x [T, hidden] or [B, S, hidden]; router [T, E] logits
    weights = (inputs[2], opt(inputs, 3), inputs[4], opt(inputs, 5), opt(inputs, 6), opt(inputs, 7))
    where = f"MoE node {ctx.node_name!r}"
    k = attrs.get("k", 1)
    xs = x.reshape(-1, x.shape[-1])  # [T, hidden]
    n_tok, n_exp = xs.shape[0], router.shape[-1]
    why = triton_moe_refusal(xs, weights, attrs)
    routed = _route_kernel(router, k, attrs, where) if why is None else None
    ROUTED_BY[ctx.node_name] = "torch" if routed is None else "kernel"
    if routed is None:
        (top_w, top_e), plan = _route_torch(router, k, attrs, where), None  # [T, k]
    else:
        top_e, top_w, plan = routed
    if ROUTE_LOG is not None and not (top_e.is_cuda and torch.cuda.is_current_stream_capturing()):
        ROUTE_LOG.setdefault(ctx.node_name, []).append(top_e.detach().clone())
    if why is None:  # CUDA: two grouped GEMM launches, no host read
        out = _fused(xs, top_e, top_w, weights, attrs, where, plan)
        if out is not None:
            ROUTES[ctx.node_name] = "triton"
            return [out.to(x.dtype).reshape(x.shape)]
        why = f"the fused kernel failed: {TRITON_FAILURE[0]}"
    REFUSED[ctx.node_name] = why
    weights = tuple(_dense(t, where) for t in weights)  # QMoE's packed experts (the fused path failed)
    rows = torch.arange(n_tok, device=x.device).repeat_interleave(k)  # [T*k] token of each route
    route_e, route_w = top_e.reshape(-1), top_w.reshape(-1)
    if n_tok * k > n_exp and n_tok <= DENSE_MAX_TOKENS and x.is_cuda:  # decode on CUDA: every expert, densely
        ROUTES[ctx.node_name] = "dense"
        dense = torch.zeros(n_tok, n_exp, dtype=torch.float32, device=x.device).scatter_(1, top_e, top_w)  # [T, E]
        y = _all_experts(xs, weights, attrs, where)  # [E, T, hidden]
        out = (y * dense.T.unsqueeze(-1)).sum(0)
        return [out.to(x.dtype).reshape(x.shape)]
    if n_tok * k <= n_exp:  # gather the chosen experts' weights: no host read
        ROUTES[ctx.node_name] = "gather"
        y = _experts(xs[rows], route_e, weights, attrs, where).float()
        contrib, dest = y * route_w.unsqueeze(-1), rows
    else:  # group routes by expert
        ROUTES[ctx.node_name] = "grouped"
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


_QMOE_FC = {"fc1": (2, 3, 4, 11), "fc2": (5, 6, 7, 12), "fc3": (8, 9, 10, 13)}  # weights, scales, bias, zero points
# the expert weight inputs (fc1, fc2, fc3) of each op; apps/bench/floor.py counts a step's products from them
EXPERT_WEIGHT_INPUTS = {"MoE": (2, 4, 6), "QMoE": tuple(v[0] for v in _QMOE_FC.values())}


def _qmoe_check(inputs, attrs, where: str) -> None:
    if attrs.get("quant_type", "int") != "int":
        raise NotImplementedError(f"{where}: quant_type {attrs['quant_type']!r} is not supported (only 'int')")
    if attrs.get("weights_prepacked", -1) not in (-1, 0):
        raise NotImplementedError(f"{where}: weights_prepacked={attrs['weights_prepacked']} (EP-specific layout)")
    extra = [i for i in range(14, 21) if opt(inputs, i) is not None]
    if extra:
        raise NotImplementedError(f"{where}: inputs {extra} (router_weights, global / activation scales) are not "
                                  "supported")
    for fc, (w, s, _, _) in _QMOE_FC.items():
        bits = attrs.get(f"{fc}_expert_weight_bits", attrs.get("expert_weight_bits", 4))
        if opt(inputs, w) is not None and bits not in (2, 4, 8):
            raise NotImplementedError(f"{where}: {fc} expert_weight_bits={bits} is not supported (2, 4 or 8)")
        if opt(inputs, w) is not None and opt(inputs, w).dtype == torch.uint8 and opt(inputs, s) is None:
            raise ValueError(f"{where}: {fc}_scales is required for integer expert weights")


def dequantize_experts(q: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, bits: int,
                       block_size: int, where: str) -> torch.Tensor:
    """QMoE expert weights uint8 [E, N, K * bits / 8] -> [E, N, K] in the scales' dtype."""
    e, n = q.shape[:2]
    v = unpack_bits(q, bits).to(torch.float32)  # [E, N, K]
    k = v.shape[-1]
    groups = k // block_size if block_size else 1
    if block_size and k % block_size:
        raise ValueError(f"{where}: K={k} is not a multiple of block_size {block_size}")
    s = scales.reshape(e, n, groups).to(torch.float32)
    if zero_points is None:
        z = torch.full((), float(1 << (bits - 1)))
    else:
        z = unpack_bits(zero_points.reshape(e, -1) if not block_size else zero_points, bits)
        z = (z[:, :n] if not block_size else z[..., :groups]).reshape(e, n, groups).to(torch.float32)
    w = (v.reshape(e, n, groups, -1) - (z.unsqueeze(-1) if z.dim() else z)) * s.unsqueeze(-1)
    return w.reshape(e, n, k).to(scales.dtype)


def _qmoe_weights(inputs, attrs, where: str) -> list[torch.Tensor | None]:
    """[fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b] with the weights dequantized (or already, by the prepack)."""
    out = []
    for fc, (w, s, b, z) in _QMOE_FC.items():
        q = opt(inputs, w)
        q = q.weight if isinstance(q, DequantizedExperts) else q
        if q is not None and q.dtype != torch.uint8 and isinstance(opt(inputs, z), torch.Tensor):
            raise ValueError(f"{where}: {fc} weights were dequantized at creation without zero points, but the "
                             f"node got a zero-point tensor (a run-time value the prepack step could not see)")
        if q is not None and q.dtype == torch.uint8:
            bits = attrs.get(f"{fc}_expert_weight_bits", attrs.get("expert_weight_bits", 4))
            zp = opt(inputs, z)
            q = dequantize_experts(q, inputs[s], zp if isinstance(zp, torch.Tensor) else None, bits,
                                   attrs.get("block_size", 0), where)
        out += [q, opt(inputs, b)]
    return out


class DequantizedExperts(nbits.Packed):
    """QMoE expert weights dequantized once at creation: `weight` [E, N, K] in the scales' dtype."""

    def __init__(self, w: torch.Tensor, fc: str):
        self.weight, self.shape, self.dtype = w, tuple(w.shape), w.dtype
        self.nbytes = w.numel() * w.element_size()
        self.layout = f"{fc} experts dequantized {str(w.dtype).removeprefix('torch.')}"
        nbits.reserve(self, self.nbytes)


def _packed(inputs, attrs) -> list | None:
    """[fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b] with each integer weight as the fused kernel's PackedExperts
    (dequantized in its loads); None when the kernels are not available or a weight was dequantized at creation."""
    tk = triton_kernels("moe")
    if tk is None:
        return None
    out = []
    for fc, (w, s, b, z) in _QMOE_FC.items():
        q = opt(inputs, w)
        if isinstance(q, DequantizedExperts):
            return None
        if q is not None and q.dtype == torch.uint8:
            zp = opt(inputs, z)
            q = tk.PackedExperts(q, inputs[s], zp if isinstance(zp, torch.Tensor) else None,
                                 attrs.get(f"{fc}_expert_weight_bits", attrs.get("expert_weight_bits", 4)),
                                 attrs.get("block_size", 0))
        out += [q, opt(inputs, b)]
    return out


def _dense(w, where: str):
    """A fused-kernel PackedExperts as the dequantized tensor the torch path takes (anything else as it is)."""
    if w is None or isinstance(w, torch.Tensor):
        return w
    return dequantize_experts(w.q, w.scales, w.zero_points, w.bits, w.block_size, where)


@register("QMoE", domain=MS_DOMAIN)
def qmoe(inputs, attrs, ctx):
    where = f"QMoE node {ctx.node_name!r}"
    _qmoe_check(inputs, attrs, where)
    if inputs[0].is_cuda:  # the fused kernel dequantizes the codes in its loads: no dequantized copy per call
        packed = _packed(inputs, attrs)
        xs = inputs[0].reshape(-1, inputs[0].shape[-1])
        if packed is not None and triton_moe_refusal(xs, packed, attrs) is None:
            return moe([inputs[0], inputs[1], *packed], attrs, ctx)
    w = _qmoe_weights(inputs, attrs, where)
    return moe([inputs[0], inputs[1], *w], attrs, ctx)


@prepack("QMoE", domain=MS_DOMAIN)
def prepack_qmoe(inputs, attrs, ctx):
    """Expert weights dequantized once (scales / zero points absorbed), if constants, on the CPU and within
    the dequantized-cache budget; {} otherwise."""
    where = f"QMoE node {ctx.node_name!r}"
    _qmoe_check(inputs, attrs, where)
    if nbits.mode() == "off" or torch.device(ctx.device).type != "cpu":
        return {}
    fcs = [(fc, idx) for fc, idx in _QMOE_FC.items() if isinstance(opt(inputs, idx[0]), torch.Tensor)]
    if not fcs or any(not isinstance(opt(inputs, s), torch.Tensor) for _, (_, s, _, _) in fcs):
        return {}
    if any(opt(inputs, z) is RUNTIME for _, (_, _, _, z) in fcs):  # absorbed zero points must be constants
        return {}
    deq = _qmoe_weights(inputs, attrs, where)
    nbytes = sum(t.numel() * t.element_size() for t in deq[0::2] if t is not None)
    if not nbits.fits_budget(nbytes):
        return {}
    out = {}
    for fc, (w, s, _, z) in fcs:
        out[s] = nbits.Absorbed(w, f"{fc}_scales")
        if opt(inputs, z) is not None:
            out[z] = nbits.Absorbed(w, f"{fc}_zero_points")
        out[w] = DequantizedExperts(deq[2 * list(_QMOE_FC).index(fc)], fc)  # last: the session reports it
    return out
