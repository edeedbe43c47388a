"""The products runtime/fuse_linear.py makes on CUDA (fused domain): a MatMul over a constant weight W [K, N], held
transposed as W^T [N, K], with the norm or SiluMul before it folded in.

    Linear(x, W^T) -> y                                 y = x @ W
    SiluLinear(y2, W^T) -> h                            h = SiluMul(y2) @ W       (attribute split = K)
    NormLinear(x, skip | '', gamma, W^T) -> (y, sum?)   y = norm(x (+ skip)) @ W; sum: x + skip (the norm's output 3)

At most kernels/triton/linear.MAX_ROWS rows on CUDA (with `TRITON` on) run as one Triton launch; otherwise the ops
they replaced run (the norm's own implementation, SiluMul's, then F.linear on W^T).
"""

from __future__ import annotations

import torch.nn.functional as F

from .registry import FUSED_DOMAIN, register
from .util import triton_kernels

TRITON = True  # run served products on the Triton kernel (benchmarks/step_profile.py --sweep nolinear turns it off)


def _kernel(kind, x, wt, **kw):
    """kernels/triton/linear.py when it serves this call (CUDA, or CPU tensors under the interpreter), else None."""
    if not TRITON:
        return None
    tk = triton_kernels("linear")
    if tk is None or tk.serves(kind, x, wt, skip=kw.get("skip"), gamma=kw.get("gamma")):
        return None
    return tk


@register("Linear", domain=FUSED_DOMAIN)
def linear(inputs, attrs, ctx):
    x, wt = inputs[0], inputs[1]
    tk = _kernel("plain", x, wt)
    if tk is not None:
        return [tk.linear("plain", x, wt)[0]]
    return [F.linear(x, wt)]


@register("SiluLinear", domain=FUSED_DOMAIN)
def silu_linear(inputs, attrs, ctx):
    y, wt = inputs[0], inputs[1]
    tk = _kernel("silu", y, wt)
    if tk is not None:
        return [tk.linear("silu", y, wt)[0]]
    h = attrs["silu_impl"]([y], {"split": attrs["split"]}, ctx)[0]
    return [F.linear(h, wt)]


@register("NormLinear", domain=FUSED_DOMAIN)
def norm_linear(inputs, attrs, ctx):
    x, skip, gamma, wt = inputs[0], inputs[1], inputs[2], inputs[3]
    want_sum = ctx.wants(1) if ctx is not None and ctx.num_outputs > 1 else False
    tk = _kernel("rms", x, wt, skip=skip, gamma=gamma)
    if tk is not None:
        y, s = tk.linear("rms", x, wt, skip=skip, gamma=gamma, eps=attrs["epsilon"], want_sum=want_sum)
        return [y, s] if ctx is None or ctx.num_outputs > 1 else [y]
    norm_in = [x, skip, gamma] if attrs["norm_op"] == "SkipSimplifiedLayerNormalization" else [x, gamma]
    outs = attrs["norm_impl"](norm_in, attrs["norm_attrs"], attrs["norm_ctx"])
    y = F.linear(outs[0], wt)
    if ctx is not None and ctx.num_outputs > 1:
        return [y, outs[3] if len(outs) > 3 else None]
    return [y]
