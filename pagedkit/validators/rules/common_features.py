"""Feature rules shared by PagedAttention and GroupQueryAttention, with identical text for both ops:
head size, rotary pairing, head_sink, QK-norm, qk_output, attention_bias broadcast, quantization
presence. Each helper takes the rule-id prefix ("PA" / "GQA") and the op's derived dims.
"""

from __future__ import annotations

from typing import Iterator

from ..issues import Issue
from ..nodeview import NodeView, TensorInfo
from .common import (
    QUANTIZED_CACHE_TYPES, dim, dtype_of, has_rank, inp, int_attr, ival, outp, shape_str,
)




def head_size_rules(view: NodeView, p: str, hidden: int | None, packed: bool | None,
                    nh: int | None, kv: int | None) -> Iterator[Issue]:
    """query hidden divisibility and head_size % 8 (packed or unpacked query)."""
    if hidden is None or nh is None or packed is None:
        return
    if packed:
        if kv is None:
            return
        div = nh + 2 * kv
        if hidden % div != 0:
            yield view.issue(inp("query"), f"{p}-packed-hidden", f"a multiple of num_heads + 2 * kv_num_heads ({div})",
                             hidden, f"Input 'query' (packed QKV) dimension {view_hidden_axis(view)} must be a "
                             f"multiple of num_heads + 2 * kv_num_heads = {div}")
            return
    else:
        div = nh
        if hidden % div != 0:
            yield view.issue(inp("query"), f"{p}-head-size-divisible", f"a multiple of num_heads ({nh})", hidden,
                             f"Input 'query' dimension {view_hidden_axis(view)} must be a multiple of num_heads = {nh}")
            return
    hs = hidden // div
    if hs % 8 != 0:
        yield view.issue(inp("query"), f"{p}-head-size-multiple-8", "head_size a multiple of 8", f"head_size {hs}",
                         f"head_size (from input 'query' dimension {view_hidden_axis(view)}: {hidden} / {div}) "
                         f"must be a multiple of 8. Got head_size % 8 == {hs % 8}")


def view_hidden_axis(view: NodeView) -> int:
    return view.contract.input("query").rank - 1


def rotary_presence_rules(view: NodeView, p: str, extra_unused: tuple[str, ...] = ()) -> Iterator[Issue]:
    cos, sin = view.t("cos_cache"), view.t("sin_cache")
    do_rotary = int_attr(view, "do_rotary")
    if (cos is None) != (sin is None):
        missing = "sin_cache" if sin is None else "cos_cache"
        yield view.issue(inp(missing), f"{p}-rotary-pair", "cos_cache and sin_cache both present or both absent",
                         f"only '{'cos_cache' if sin is None else 'sin_cache'}' given",
                         "Input 'cos_cache' and 'sin_cache' shall be both present or both absent")
    elif do_rotary == 1 and cos is None:
        yield view.issue(inp("cos_cache"), f"{p}-rotary-missing", "cos_cache and sin_cache present", "absent",
                         "Input 'cos_cache' and 'sin_cache' must be provided when do_rotary is 1")
    if do_rotary == 0:
        for name in ("cos_cache", "sin_cache") + extra_unused:
            if view.has(name):
                yield view.issue(inp(name), f"{p}-rotary-unused", "absent when do_rotary=0 (or do_rotary=1)",
                                 "present", f"Input '{name}' is given but do_rotary is 0; it would be ignored")
    if cos is not None and sin is not None and cos.shape is not None and sin.shape is not None:
        if len(cos.shape) == len(sin.shape) and any(ival(a) is not None and ival(b) is not None and a != b
                                                    for a, b in zip(cos.shape, sin.shape)):
            yield view.issue(inp("sin_cache"), f"{p}-rotary-shape-match", f"same shape as cos_cache {shape_str(cos)}",
                             shape_str(sin), "Input 'sin_cache' must have the same shape as 'cos_cache'")


def head_sink_rules(view: NodeView, p: str, nh: int | None) -> Iterator[Issue]:
    t = view.t("head_sink")
    if has_rank(t, 1) and nh is not None and dim(t, 0) is not None and dim(t, 0) != nh:
        yield view.issue(inp("head_sink"), f"{p}-head-sink-shape", f"({nh}) = (num_heads)", shape_str(t),
                         f"Input 'head_sink' dimension 0 must be equal to num_heads ({nh}), got {dim(t, 0)}")


def qk_norm_rules(view: NodeView, p: str, head_size: int | None) -> Iterator[Issue]:
    q, k = view.t("q_norm_weight"), view.t("k_norm_weight")
    if (q is None) != (k is None):
        missing = "k_norm_weight" if k is None else "q_norm_weight"
        yield view.issue(inp(missing), f"{p}-qk-norm-pair", "q_norm_weight and k_norm_weight both present or both absent",
                         f"'{missing}' absent", "Input 'q_norm_weight' and 'k_norm_weight' must be provided together")
    for name, t in (("q_norm_weight", q), ("k_norm_weight", k)):
        if has_rank(t, 1) and head_size is not None and dim(t, 0) is not None and dim(t, 0) != head_size:
            yield view.issue(inp(name), f"{p}-qk-norm-shape", f"({head_size}) = (head_size)", shape_str(t),
                             f"Input '{name}' dimension 0 must be equal to head_size ({head_size}), got {dim(t, 0)}")


def qk_output_rules(view: NodeView, p: str) -> Iterator[Issue]:
    qk = int_attr(view, "qk_output")
    present = view.has_output("output_qk")
    if present is None or qk is None:
        return
    if qk != 0 and not present:
        idx = view.contract.output_index("output_qk")
        yield view.issue(outp("output_qk"), f"{p}-qk-output-missing", f"a named output {idx} 'output_qk'", "absent",
                         f"qk_output={qk} requires output 'output_qk' (output {idx}) to be named")
    elif qk == 0 and present:
        yield view.issue(outp("output_qk"), f"{p}-qk-output-unrequested", "qk_output 1 or 2 (or no output_qk)",
                         "qk_output=0", "Output 'output_qk' is named but attribute 'qk_output' is 0")


def bias_broadcast_rules(view: NodeView, p: str, batch: int | None, nh: int | None) -> Iterator[Issue]:
    t = view.t("attention_bias")
    if not has_rank(t, 4):
        return
    d0, d1 = dim(t, 0), dim(t, 1)
    if d0 is not None and batch is not None and d0 not in (1, batch):
        yield view.issue(inp("attention_bias"), f"{p}-bias-batch", f"1 or batch_size ({batch})", d0,
                         f"Input 'attention_bias' dimension 0 must be equal to the batch size ({batch}) or 1, got {d0}")
    if d1 is not None and nh is not None and d1 not in (1, nh):
        yield view.issue(inp("attention_bias"), f"{p}-bias-heads", f"1 or num_heads ({nh})", d1,
                         f"Input 'attention_bias' dimension 1 must be equal to num_heads ({nh}) or 1, got {d1}")


def scale_presence_rule(view: NodeView, p: str, side: str, qt: str | None, needs_scale: bool) -> Iterator[Issue]:
    """k/v_scale present iff the side's quant type uses a static scale (needs_scale)."""
    if qt is None:
        return
    scale = f"{side}_scale"
    has = view.has(scale)
    if needs_scale and not has:
        yield view.issue(inp(scale), f"{p}-scale-missing", f"input '{scale}' present", "absent",
                         f"Input '{scale}' must be provided when {side}_quant_type is {qt}")
    elif has and not needs_scale:
        yield view.issue(inp(scale), f"{p}-scale-unexpected", f"'{scale}' absent for {side}_quant_type {qt}",
                         "present", f"Input '{scale}' is given but {side}_quant_type is {qt}")


def cache_quant_rules(view: NodeView, p: str, side: str, where: str, cache: TensorInfo | None,
                      qt: str | None, t_dtype: str | None) -> Iterator[Issue]:
    """quant type != NONE <=> the cache holds a quantized (non-T) element type. where names the cache
    tensor ("input 'key_cache'", or a present output when there is no past input)."""
    cdt = dtype_of(cache)
    if cdt is None or qt is None:
        return
    quantized = cdt in QUANTIZED_CACHE_TYPES
    label = where.capitalize()
    if qt != "NONE" and not quantized:
        yield view.issue(where, f"{p}-quant-needs-quantized-cache",
                         f"an int8 / float8e4m3fn / uint8 (int4) cache for {side}_quant_type {qt}", cdt,
                         f"{side}_quant_type is {qt} but {where} has unquantized element type {cdt}")
    elif qt == "NONE" and (quantized or (t_dtype is not None and cdt != t_dtype)):
        yield view.issue(where, f"{p}-cache-dtype-needs-quant",
                         f"element type T ({t_dtype}) when {side}_quant_type is NONE", cdt,
                         f"{label} has element type {cdt} but {side}_quant_type is NONE")
