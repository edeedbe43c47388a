"""`decode_linear`: the fusion that lets a CUDA decode step run its products on kernels/triton/linear.py (a rule of
fuse.py, applied to CUDA sessions when PAGEDKIT_DECODE_LINEAR is on). Each MatMul over a constant 2-D float16 /
bfloat16 weight W [K, N] (at least MIN_BYTES, N <= MAX_N: not an LM head) becomes one of

    NormLinear(x, skip | '', gamma, W^T) -> (y, sum | '')  the norm before it, whose output only it reads
        (SkipSimplifiedLayerNormalization without bias, SimplifiedLayerNormalization, RMSNormalization, last axis)
    SiluLinear(y, W^T) -> h                                 the SiluMul before it (fuse.py's swiglu_mlp), read by it
    Linear(x, W^T) -> y                                      otherwise

with W transposed once to [N, K] (the original dropped when nothing else reads it). ENABLED: True every such
product, False none, "measured" (the default) those whose (kind, N, K) has tiles measured on a GPU
(kernels/triton/linear.SHAPE_TILES; kind "rms" for a folded norm, "silu", "plain"). The fused ops
(runtime/ops/linear.py) run the Triton kernel for at most kernels/triton/linear.MAX_ROWS rows, and otherwise the
ops they replaced (the norm / SiluMul, then F.linear on W^T): a prefill's products stay on cuBLAS.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .. import settings
from .ops.registry import FUSED_DOMAIN, MS_DOMAIN, lookup
from .steps import Graph, Step, plain_step, value_readers

ENABLED: bool | str = settings.read("PAGEDKIT_DECODE_LINEAR")
DEVICES = ("cuda",)  # where the rule applies (the CPU tests add "cpu": the ops then run in Triton's interpreter)
MIN_BYTES = 1 << 20
MAX_N = 65536
NORMS = {(MS_DOMAIN, "SkipSimplifiedLayerNormalization"): 1e-12, ("", "SimplifiedLayerNormalization"): 1e-5,
         ("", "RMSNormalization"): 1e-5}  # (domain, op) -> default epsilon


def _weight(g: Graph, step: Step):
    """MatMul step's constant weight when the rule takes it, else None."""
    if not plain_step(step, "MatMul", 2):
        return None
    w = g.consts.get(step.inputs[1])
    if (not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in (torch.float16, torch.bfloat16)
            or w.numel() * w.element_size() < MIN_BYTES or w.shape[1] > MAX_N):
        return None
    return w


def _norm_fold(norm: Step, readers: dict, x_name: str) -> tuple[list[str], list[str], float] | None:
    """(inputs [x, skip | '', gamma], extra outputs [sum | ''], epsilon) of a norm the product may fold, or None."""
    key = (norm.domain, norm.op_type)
    if key not in NORMS or norm.impl is None or norm.outputs[0] != x_name or readers.get(x_name, 0) != 1:
        return None
    outs = list(norm.outputs) + [""] * 4
    if norm.op_type == "SkipSimplifiedLayerNormalization":
        if len(norm.inputs) < 3 or any(norm.inputs[3:]) or any(readers.get(o, 0) for o in outs[1:3] if o):
            return None
        ins, extra = [norm.inputs[0], norm.inputs[1], norm.inputs[2]], [outs[3] if readers.get(outs[3], 0) else ""]
    else:
        if len(norm.inputs) != 2 or any(readers.get(o, 0) for o in outs[1:3] if o):
            return None
        if int(norm.attrs.get("axis", -1)) != -1:
            return None
        ins, extra = [norm.inputs[0], "", norm.inputs[1]], []
    if int(norm.attrs.get("stash_type", 1)) != 1:
        return None
    return ins, extra, float(norm.attrs.get("epsilon", NORMS[key]))


def _measured() -> set:
    """The (kind, N, K) shapes with measured tiles (kernels/triton/linear.SHAPE_TILES); empty without Triton."""
    from .ops.util import triton_kernels

    lin = triton_kernels("linear")
    return set(lin.SHAPE_TILES) if lin is not None else set()


def _fold(g: Graph, producer: dict, readers: dict, gone: set, x: str) -> tuple[str, Step | None, tuple | None]:
    """(the kernel kind the product reading x becomes: "silu", "rms" or "plain"; the step it folds, None for
    plain; the norm's (inputs, extra outputs, epsilon) for rms)."""
    prev = producer.get(x)
    if prev is None or id(prev) in gone or readers.get(x, 0) != 1 or x in g.outputs:
        return "plain", None, None
    if prev.domain == FUSED_DOMAIN and prev.op_type == "SiluMul" and prev.impl is not None:
        return "silu", prev, None
    fold = _norm_fold(prev, readers, x)
    return ("rms", prev, fold) if fold is not None else ("plain", None, None)


def _wanted(measured: set, kind: str, w: torch.Tensor) -> bool:
    k, n = w.shape  # W [K, N]
    return (kind, int(n), int(k)) in measured


def decode_linear(g: Graph, device: torch.device) -> int:
    """The rewrite (module docstring) when ENABLED on one of DEVICES; the rewrites made."""
    if not (ENABLED and device.type in DEVICES):
        return 0
    measured = _measured() if ENABLED == "measured" else None
    if measured is not None and not measured:
        return 0
    readers = value_readers(g)
    producer = {o: s for s in g.steps for o in s.outputs if o}
    gone: set[int] = set()
    placed: dict[int, Step] = {}
    transposed: dict[str, str] = {}
    done = 0
    for mm in g.steps:
        w = _weight(g, mm)
        if w is None or id(mm) in gone:
            continue
        x, w_name = mm.inputs
        kind, prev, fold = _fold(g, producer, readers, gone, x)
        if measured is not None and not _wanted(measured, kind, w):
            continue
        if w_name not in transposed:
            transposed[w_name] = f"{w_name}::t"
            g.consts[transposed[w_name]] = w.T.contiguous()  # [N, K]
        wt = transposed[w_name]
        ctx = replace(mm.ctx, num_outputs=1, requested=(True,)) if mm.ctx else None
        new = None
        if kind == "silu":
            new = Step(f"{prev.name}+{mm.name}", "SiluLinear", FUSED_DOMAIN, [prev.inputs[0], wt], list(mm.outputs),
                       {"split": int(prev.attrs["split"]), "silu_impl": prev.impl},
                       impl=lookup(FUSED_DOMAIN, "SiluLinear", 1, mm.name), ctx=ctx)
        elif kind == "rms":
            ins, extra, eps = fold
            new = Step(f"{prev.name}+{mm.name}", "NormLinear", FUSED_DOMAIN, ins + [wt], list(mm.outputs) + extra,
                       {"epsilon": eps, "norm_impl": prev.impl, "norm_attrs": dict(prev.attrs),
                        "norm_ctx": prev.ctx, "norm_op": prev.op_type},
                       impl=lookup(FUSED_DOMAIN, "NormLinear", 1, mm.name),
                       ctx=replace(mm.ctx, num_outputs=1 + len(extra),
                                   requested=(True,) * (1 + len(extra))) if mm.ctx else None)
        if new is not None:  # at the folded op's place: its inputs are ready there, the product's are constants
            gone.update((id(prev), id(mm)))
            placed[id(prev)] = new
        else:
            new = Step(mm.name, "Linear", FUSED_DOMAIN, [x, wt], list(mm.outputs), {},
                       impl=lookup(FUSED_DOMAIN, "Linear", 1, mm.name), ctx=ctx)
            gone.add(id(mm))
            placed[id(mm)] = new
        readers[w_name] -= 1
        if readers[w_name] == 0 and w_name not in g.outputs:
            g.consts.pop(w_name, None)
        done += 1
    if done:
        g.steps = [placed[id(s)] if id(s) in placed else s for s in g.steps if id(s) not in gone or id(s) in placed]
    return done
