"""PagedAttention quantized-cache, cache-dtype, Hadamard-rotation and MLA (LATENT) rules.

Design §8.7, §12.10, contract-decisions §3 / §7 and the int4 / PER_TOKEN / rotation PR. Rule ids
are listed (without the "PA-" prefix) in DOCS; rules/paged.py RULE_DOCS publishes them.
"""

from __future__ import annotations

from typing import Iterator

from ..issues import Issue
from ..nodeview import NodeView
from .common import (
    attr_at, dim, dtype_of, fval, has_rank, inp, int_attr, is_pow2, outp, shape_str, str_attr,
)
from .common_features import (
    cache_quant_rules, scale_presence_rule,
)
from .paged_dims import LATENT, PagedDims, paged_dims

P = "PA"

DOCS = {
    "scale-shape-per-tensor": "PER_TENSOR k/v_scale must have shape (1).",
    "scale-shape-per-channel": "PER_CHANNEL k/v_scale must have shape (kv_num_heads, 1, head_size).",
    "scale-cache-missing": "PER_TOKEN requires k/v_scale_cache (input 17 / 18).",
    "scale-cache-unexpected": "k/v_scale_cache given although the side's quant type is not PER_TOKEN.",
    "scale-cache-out-missing": "PER_TOKEN requires output k/v_scale_cache_out (output 3 / 4) to be named.",
    "scale-cache-out-unexpected": "k/v_scale_cache_out named although the side's quant type is not PER_TOKEN.",
    "scale-cache-shape": "k/v_scale_cache must be (num_blocks, block_size, kv_num_heads).",
    "cache-dtype-attr": "k/v_cache_dtype must be '' or name the cache tensor's own element type.",
    "cache-dtype-reserved": "k/v_cache_dtype 'float4e2m1' is reserved and rejected.",
    "int4-needs-uint8": "k/v_cache_dtype 'int4' requires a uint8 cache tensor.",
    "int4-needs-quant": "k/v_cache_dtype 'int4' requires k/v_quant_type != NONE.",
    "uint8-needs-int4": "A uint8 cache requires k/v_cache_dtype 'int4'.",
    "rotation-pow2": "qk_rotation / v_rotation require head_size to be a power of two.",
    "rotation-latent": "qk_rotation / v_rotation are rejected with kv_cache_layout LATENT.",
    "rotation-per-channel": "A rotated side (qk_rotation: K, v_rotation: V) cannot use PER_CHANNEL.",
    "latent-kv-heads": "LATENT requires kv_num_heads == 1.",
    "latent-scale": "LATENT with v_head_size != head_size requires an explicit scale > 0.",
    "latent-head-sink": "LATENT rejects head_sink.",
    "latent-qk-norm": "LATENT rejects q_norm_weight / k_norm_weight.",
    "latent-v-scale": "LATENT rejects v_scale (k_scale describes the one cache).",
    "latent-v-quant": "LATENT requires v_quant_type NONE.",
    "latent-v-cache-dtype": "LATENT requires v_cache_dtype ''.",
    "latent-v-scale-cache": "LATENT rejects v_scale_cache / v_scale_cache_out.",
    "v-head-size-separate": "v_head_size != 0 and != head_size requires kv_cache_layout LATENT.",
}

_EXPLICIT_DTYPES = ("float16", "bfloat16", "int8", "float8e4m3fn")


def _sides(d: PagedDims):
    """(side, quant type, cache input) per side that exists: V has no cache side in LATENT."""
    yield "k", d.k_qt, "key_cache"
    if d.layout != LATENT:
        yield "v", d.v_qt, "value_cache"


def quant_scales(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    for side, qt, _ in _sides(d):
        yield from scale_presence_rule(view, P, side, qt, qt in ("PER_TENSOR", "PER_CHANNEL"))
        scale = view.t(f"{side}_scale")
        if scale is not None and scale.shape is not None and qt == "PER_TENSOR":
            if not (scale.rank == 1 and dim(scale, 0) in (1, None)):
                yield view.issue(inp(f"{side}_scale"), f"{P}-scale-shape-per-tensor", "(1) for PER_TENSOR",
                                 shape_str(scale), f"Input '{side}_scale' must have shape (1) when "
                                 f"{side}_quant_type is PER_TENSOR")
        if scale is not None and scale.shape is not None and qt == "PER_CHANNEL":
            want = (d.kv, 1, d.head_size)
            bad = scale.rank != 3 or any(dim(scale, i) is not None and w is not None and dim(scale, i) != w
                                         for i, w in enumerate(want))
            if bad:
                shown = f"({d.kv if d.kv else 'kv_num_heads'}, 1, {d.head_size if d.head_size else 'head_size'})"
                yield view.issue(inp(f"{side}_scale"), f"{P}-scale-shape-per-channel",
                                 f"{shown} = (kv_num_heads, 1, head_size) for PER_CHANNEL", shape_str(scale),
                                 f"Input '{side}_scale' must have shape (kv_num_heads, 1, head_size) when "
                                 f"{side}_quant_type is PER_CHANNEL")


def scale_caches(view: NodeView) -> Iterator[Issue]:
    """PER_TOKEN: scale cache input 17/18 and output 3/4 present iff that side is PER_TOKEN."""
    d = paged_dims(view)
    for side, qt, _ in _sides(d):
        if qt is None:
            continue
        name, oname = f"{side}_scale_cache", f"{side}_scale_cache_out"
        per_token = qt == "PER_TOKEN"
        if per_token and not view.has(name):
            yield view.issue(inp(name), f"{P}-scale-cache-missing", f"input '{name}' present", "absent",
                             f"Input '{name}' must be provided when {side}_quant_type is PER_TOKEN")
        elif view.has(name) and not per_token:
            yield view.issue(inp(name), f"{P}-scale-cache-unexpected", f"absent for {side}_quant_type {qt}",
                             "present", f"Input '{name}' is given but {side}_quant_type is {qt}, not PER_TOKEN")
        out = view.has_output(oname)
        if out is not None:
            if per_token and not out:
                yield view.issue(outp(oname), f"{P}-scale-cache-out-missing", f"output '{oname}' named", "absent",
                                 f"Output '{oname}' must be named when {side}_quant_type is PER_TOKEN")
            elif out and not per_token:
                yield view.issue(outp(oname), f"{P}-scale-cache-out-unexpected",
                                 f"absent for {side}_quant_type {qt}", "named",
                                 f"Output '{oname}' is named but {side}_quant_type is {qt}, not PER_TOKEN")
        t = view.t(name)
        if has_rank(t, 3):
            for i, want, what in ((0, d.num_blocks, "num_blocks"), (1, d.block_size, "block_size"),
                                  (2, d.kv, "kv_num_heads")):
                got = dim(t, i)
                if got is not None and want is not None and got != want:
                    yield view.issue(inp(name), f"{P}-scale-cache-shape", f"{want} ({what})", got,
                                     f"Input '{name}' dimension {i} should be {what} ({want}), got {got}")


def cache_dtypes(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    for side, qt, cache_name in _sides(d):
        attr = f"{side}_cache_dtype"
        a = str_attr(view, attr)
        cdt = dtype_of(view.t(cache_name))
        if a == "float4e2m1":
            yield view.issue(attr_at(attr), f"{P}-cache-dtype-reserved", "'' or a supported cache dtype",
                             repr(a), f"Attribute '{attr}' value 'float4e2m1' is reserved and not supported")
            continue
        if a == "int4":
            if cdt is not None and cdt != "uint8":
                yield view.issue(inp(cache_name), f"{P}-int4-needs-uint8", f"a uint8 '{cache_name}' for "
                                 f"{attr}='int4'", cdt, f"Attribute '{attr}' is 'int4' but input '{cache_name}' "
                                 f"has element type {cdt}; int4 is packed two per byte in a uint8 cache")
            if qt == "NONE":
                yield view.issue(attr_at(f"{side}_quant_type"), f"{P}-int4-needs-quant",
                                 "PER_TENSOR, PER_CHANNEL or PER_TOKEN for an int4 cache", "NONE",
                                 f"Attribute '{attr}' is 'int4' but {side}_quant_type is NONE")
            else:
                yield from cache_quant_rules(view, P, side, inp(cache_name), view.t(cache_name), qt, None)
            continue
        if a in _EXPLICIT_DTYPES and cdt is not None and cdt != a:
            yield view.issue(attr_at(attr), f"{P}-cache-dtype-attr", f"'' or '{cdt}' (the type of '{cache_name}')",
                             repr(a), f"Attribute '{attr}' is '{a}' but input '{cache_name}' has element type {cdt}")
        if cdt == "uint8":
            yield view.issue(inp(cache_name), f"{P}-uint8-needs-int4", f"{attr}='int4' for a uint8 cache",
                             f"{attr}={a!r}", f"Input '{cache_name}' is uint8, which requires {attr}='int4'")
        yield from cache_quant_rules(view, P, side, inp(cache_name), view.t(cache_name), qt, d.t_dtype)


def rotation(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    for name, side, qt in (("qk_rotation", "k", d.k_qt), ("v_rotation", "v", d.v_qt)):
        if int_attr(view, name) != 1:
            continue
        if d.head_size is not None and not is_pow2(d.head_size):
            yield view.issue(attr_at(name), f"{P}-rotation-pow2", "head_size a power of two",
                             f"head_size {d.head_size}", f"Attribute '{name}'=1 requires head_size to be a power "
                             f"of two (Walsh-Hadamard), got head_size {d.head_size}")
        if d.layout == LATENT:
            yield view.issue(attr_at(name), f"{P}-rotation-latent", f"{name}=0 with kv_cache_layout LATENT", 1,
                             f"Attribute '{name}' is not supported with kv_cache_layout LATENT")
        elif qt == "PER_CHANNEL":
            yield view.issue(attr_at(name), f"{P}-rotation-per-channel",
                             f"{side}_quant_type NONE, PER_TENSOR or PER_TOKEN with {name}=1", "PER_CHANNEL",
                             f"Attribute '{name}'=1 cannot be combined with {side}_quant_type PER_CHANNEL "
                             "(a static per-channel scale does not survive the rotation)")


def latent(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    vhs = int_attr(view, "v_head_size")
    if d.layout != LATENT:
        if d.layout is not None and vhs is not None and vhs > 0 and d.head_size is not None and vhs != d.head_size:
            yield view.issue(attr_at("v_head_size"), f"{P}-v-head-size-separate", f"0 or head_size ({d.head_size}) "
                             "unless kv_cache_layout is LATENT", vhs, "Attribute 'v_head_size' may differ from "
                             f"head_size ({d.head_size}) only when kv_cache_layout is LATENT")
        return
    kv = int_attr(view, "kv_num_heads")
    if kv is not None and kv > 0 and kv != 1:
        yield view.issue(attr_at("kv_num_heads"), f"{P}-latent-kv-heads", "1 (LATENT)", kv,
                         "Attribute 'kv_num_heads' must be 1 when kv_cache_layout is LATENT")
    scale = view.attrs.get("scale")
    if vhs is not None and vhs > 0 and d.head_size is not None and vhs != d.head_size:
        if not (fval(scale) is not None and fval(scale) > 0):
            yield view.issue(attr_at("scale"), f"{P}-latent-scale", "an explicit scale > 0", repr(scale),
                             f"Attribute 'scale' is required when v_head_size ({vhs}) differs from head_size "
                             f"({d.head_size}); 1/sqrt(head_size) would be the wrong default")
    for name, rid in (("head_sink", "latent-head-sink"), ("q_norm_weight", "latent-qk-norm"),
                      ("k_norm_weight", "latent-qk-norm"), ("v_scale", "latent-v-scale"),
                      ("v_scale_cache", "latent-v-scale-cache")):
        if view.has(name):
            yield view.issue(inp(name), f"{P}-{rid}", "absent (LATENT)", "present",
                             f"Input '{name}' must be absent when kv_cache_layout is LATENT")
    if view.has_output("v_scale_cache_out"):
        yield view.issue(outp("v_scale_cache_out"), f"{P}-latent-v-scale-cache", "absent (LATENT)", "named",
                         "Output 'v_scale_cache_out' must be absent when kv_cache_layout is LATENT")
    vq = str_attr(view, "v_quant_type")
    if vq is not None and vq != "NONE":
        yield view.issue(attr_at("v_quant_type"), f"{P}-latent-v-quant", "NONE (LATENT)", repr(vq),
                         "Attribute 'v_quant_type' must be NONE when kv_cache_layout is LATENT")
    vd = str_attr(view, "v_cache_dtype")
    if vd is not None and vd != "":
        yield view.issue(attr_at("v_cache_dtype"), f"{P}-latent-v-cache-dtype", "'' (LATENT)", repr(vd),
                         "Attribute 'v_cache_dtype' must be '' when kv_cache_layout is LATENT")


RULES = [quant_scales, scale_caches, cache_dtypes, rotation, latent]
