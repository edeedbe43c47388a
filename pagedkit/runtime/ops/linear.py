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

TRITON = True  # run served products on the Triton kernel (benchmarks/step_profile.py --sweep nolin turns it off)


def _product(kind: str, a, wt, unfused, **kw):
    """(y, the rms sum or None): kernels/triton/linear.py when it serves the call (CUDA, or CPU tensors under the
    interpreter), else F.linear on what `unfused()` returns: (x, sum or None) from the replaced op(s)."""
    tk = triton_kernels("linear") if TRITON else None
    if tk is not None and tk.serves(kind, a, wt, skip=kw.get("skip"), gamma=kw.get("gamma")) is None:
        return tk.linear(kind, a, wt, **kw)
    x, s = unfused()
    return F.linear(x, wt), s


@register("Linear", domain=FUSED_DOMAIN)
def linear(inputs, attrs, ctx):
    x, wt = inputs[0], inputs[1]
    return [_product("plain", x, wt, lambda: (x, None))[0]]


@register("SiluLinear", domain=FUSED_DOMAIN)
def silu_linear(inputs, attrs, ctx):
    y, wt = inputs[0], inputs[1]
    return [_product("silu", y, wt, lambda: (attrs["silu_impl"]([y], {"split": attrs["split"]}, ctx)[0], None))[0]]


@register("NormLinear", domain=FUSED_DOMAIN)
def norm_linear(inputs, attrs, ctx):
    x, skip, gamma, wt = inputs[0], inputs[1], inputs[2], inputs[3]
    two = ctx is not None and ctx.num_outputs > 1  # the sum output (the norm's output 3) is read

    def unfused():
        norm_in = [x, skip, gamma] if attrs["norm_op"] == "SkipSimplifiedLayerNormalization" else [x, gamma]
        outs = attrs["norm_impl"](norm_in, attrs["norm_attrs"], attrs["norm_ctx"])
        return outs[0], (outs[3] if len(outs) > 3 else None)

    y, s = _product("rms", x, wt, unfused, skip=skip, gamma=gamma, eps=attrs["epsilon"],
                    want_sum=two and ctx.wants(1))
    return [y, s] if two else [y]
