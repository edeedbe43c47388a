"""Helpers and rules shared by PagedAttention and GroupQueryAttention (identical checks, identical text).

Here: small accessors (known dims, attribute values, integer contents), the per-view memo of derived
dims, and the generic rules every op runs (attributes, required inputs, element types, ranks). The
shared feature rules (head size, rotary, head_sink, QK-norm, qk_output, bias, quantization presence)
are in rules_common_features.py. Every rule helper takes the op's rule-id prefix ("PA" / "GQA");
`COMMON_DOCS` documents the shared ids by suffix and each op module prefixes them into `RULE_DOCS`.

Conventions: a dimension is checked only when it is a known int (symbolic / unknown never
conflicts); integer contents are checked only when known (`TensorInfo.value`).
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any, Iterable, Iterator

import numpy as np

from ...interface import dtypes
from ..contract import CACHE_FORMATS, OpContract
from ..issues import Issue
from ..nodeview import NodeView, TensorInfo, dtype_name, type_str

# Issues raised while building a view (nodeview.py / checks.py), shared by both ops.
VIEW_DOCS = {
    "unknown-input": "A runtime input key is not an input name of the op.",
    "unknown-output": "A requested runtime output name is not an output name of the op.",
    "too-many-inputs": "The node lists more inputs than the op defines.",
    "too-many-outputs": "The node lists more outputs than the op defines.",
}

COMMON_DOCS = {
    "attr-unknown": "An attribute the op does not define is set on the node.",
    "attr-required": "A required attribute (num_heads, kv_num_heads) is missing.",
    "attr-type": "An attribute has the wrong type (int / float / string, as the contract says).",
    "attr-allowed": "An attribute with a closed value set has a value outside it.",
    "num-heads-positive": "num_heads must be > 0.",
    "kv-num-heads-positive": "kv_num_heads must be > 0.",
    "num-heads-divisible": "num_heads must be a multiple of kv_num_heads.",
    "scale": "scale must be finite and >= 0 (0 selects 1/sqrt(head_size)).",
    "softcap": "softcap must be finite and >= 0 (0 = off).",
    "local-window": "local_window_size must be -1 (off) or > 0.",
    "norm-epsilon": "qk_norm_epsilon (and q/k_norm_epsilon for GQA) must be finite and > 0.",
    "input-required": "A required (non-optional) input is absent.",
    "output-required": "A required output (output 0) is not named.",
    "dtype-allowed": "An input or output element type is outside its type constraint.",
    "rank": "An input or output has a rank the contract does not allow.",
    "head-size-divisible": "query hidden size must be a multiple of num_heads (unpacked query).",
    "packed-hidden": "Packed QKV hidden size must be a multiple of num_heads + 2 * kv_num_heads.",
    "head-size-multiple-8": "head_size must be a multiple of 8.",
    "rotary-missing": "do_rotary=1 requires cos_cache and sin_cache.",
    "rotary-pair": "cos_cache and sin_cache must be both present or both absent.",
    "rotary-unused": "Rotary inputs given with do_rotary=0 would be silently ignored.",
    "rotary-shape-match": "cos_cache and sin_cache must have the same shape.",
    "head-sink-shape": "head_sink must have shape (num_heads).",
    "qk-norm-pair": "q_norm_weight and k_norm_weight must be both present or both absent.",
    "qk-norm-shape": "q_norm_weight / k_norm_weight must have shape (head_size).",
    "qk-output-missing": "qk_output != 0 requires a named output_qk output.",
    "qk-output-unrequested": "A named output_qk output requires qk_output != 0.",
    "scale-missing": "A quantized side (k/v_quant_type PER_TENSOR / PER_CHANNEL) requires its k/v_scale input.",
    "scale-unexpected": "k/v_scale given although the side's quant type does not use a static scale.",
    "quant-needs-quantized-cache": "A quant type != NONE requires a quantized cache element type.",
    "cache-dtype-needs-quant": "A cache element type different from T requires a quant type != NONE.",
    "bias-batch": "attention_bias dimension 0 must be 1 or batch_size.",
    "bias-heads": "attention_bias dimension 1 must be 1 or num_heads.",
}

# element-type names of caches that hold codes (int8, float8e4m3fn, uint8 = packed int4): CACHE_FORMATS' storage
QUANTIZED_CACHE_TYPES = tuple(dtypes.type_name(dtypes.elem_type(f.storage)) for f in CACHE_FORMATS.values()
                              if f.quantized)


def dtype_docs(contract: OpContract) -> dict[str, str]:
    """One rule id per type variable shared by several tensors: they must bind to one type."""
    docs = {}
    for var, members in type_var_members(contract).items():
        if len(members) > 1 and len(contract.type_constraints[var]) > 1:
            names = ", ".join(members)
            docs[f"dtype-same-{var}"] = f"All tensors of type {var} ({names}) must have one element type."
    return docs


def prefixed(prefix: str, docs: dict[str, str]) -> dict[str, str]:
    return {f"{prefix}-{k}": v for k, v in docs.items()}


# ------------------------------------------------------------------------------------------
# small helpers
# ------------------------------------------------------------------------------------------


def inp(name: str) -> str:
    return f"input '{name}'"


def outp(name: str) -> str:
    return f"output '{name}'"


def attr_at(name: str) -> str:
    return f"attribute '{name}'"


def ival(d: Any) -> int | None:
    """A known integer (dimension or attribute), else None (symbolic, unknown, wrong type)."""
    if isinstance(d, Integral) and not isinstance(d, bool):
        return int(d)
    return None


def fval(v: Any) -> float | None:
    if isinstance(v, Real) and not isinstance(v, bool):
        return float(v)
    return None


def sval(v: Any) -> str | None:
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def int_attr(view: NodeView, name: str) -> int | None:
    return ival(view.a(name))


def float_attr(view: NodeView, name: str) -> float | None:
    return fval(view.a(name))


def str_attr(view: NodeView, name: str) -> str | None:
    return sval(view.a(name))


def first_known(*dims: Any) -> int | None:
    for d in dims:
        if ival(d) is not None:
            return ival(d)
    return None


def dim(t: TensorInfo | None, i: int) -> int | None:
    """Known int dimension i of t, else None."""
    if t is None or t.shape is None or not -len(t.shape) <= i < len(t.shape):
        return None
    return ival(t.shape[i])


def shape_str(t: TensorInfo) -> str:
    return "unknown" if t.shape is None else "(" + ", ".join(str(d) for d in t.shape) + ")"


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def int_values(t: TensorInfo | None, want_rank: int | None = 1) -> np.ndarray | None:
    """Known integer contents as a flat int64 array (None when unknown or not integer / wrong rank)."""
    if t is None or t.value is None:
        return None
    try:
        arr = np.asarray(t.value)
    except Exception:
        return None
    if arr.dtype.kind not in "iu":
        return None
    if want_rank is not None and arr.ndim != want_rank:
        return None
    return arr.astype(np.int64).reshape(-1)


def dtype_of(t: TensorInfo | None) -> str | None:
    return None if t is None or t.dtype is None else dtype_name(t.dtype)


_MEMBERS: dict[str, dict[str, list[str]]] = {}


def type_var_members(contract: OpContract) -> dict[str, list[str]]:
    """Type variable -> names of the inputs and outputs bound to it (in index order)."""
    if contract.name not in _MEMBERS:
        members: dict[str, list[str]] = {}
        for p in contract.inputs + contract.outputs:
            if p.type_param in contract.type_constraints:
                members.setdefault(p.type_param, []).append(p.name)
        _MEMBERS[contract.name] = members
    return _MEMBERS[contract.name]


def _fingerprint(view: NodeView) -> tuple:
    """Everything derived dims depend on; integer contents by value, so a changed view never hits."""
    def tensor(t: TensorInfo) -> tuple:
        v = None
        if t.value is not None:
            try:
                arr = np.asarray(t.value)
                v = (arr.dtype.str, arr.shape, arr.tobytes())
            except Exception:
                v = id(t.value)
        return t.name, t.dtype, t.shape, v

    ins = tuple((i, tensor(t)) for i, t in sorted(view.inputs.items()))
    outs = None if view.outputs is None else tuple((i, tensor(t)) for i, t in sorted(view.outputs.items()))
    return repr(sorted(view.attrs.items(), key=lambda kv: str(kv[0]))), ins, outs, view.runtime


def memo_dims(view: NodeView, key: str, derive):
    """derive(view), computed once per view state: every rule of a run reads the same derived dims."""
    fp = _fingerprint(view)
    cached = view.__dict__.get(key)
    if cached is not None and cached[0] == fp:
        return cached[1]
    value = derive(view)
    view.__dict__[key] = (fp, value)
    return value


# ------------------------------------------------------------------------------------------
# attributes
# ------------------------------------------------------------------------------------------


def _attr_type_ok(view: NodeView, kind: str, value: Any) -> bool:
    if kind == "int":
        return ival(value) is not None or isinstance(value, bool)
    if kind == "float":
        if isinstance(value, float) or isinstance(value, np.floating):
            return True
        # An int for a float attribute is an INT AttributeProto in a model (ORT rejects it);
        # a Python int passed to the runtime check is fine.
        return view.runtime and ival(value) is not None
    return sval(value) is not None


def attribute_rules(view: NodeView, p: str) -> Iterator[Issue]:
    c = view.contract
    known = {a.name: a for a in c.attributes}
    for name, value in view.attrs.items():
        a = known.get(name)
        if a is None:
            yield view.issue(attr_at(name), f"{p}-attr-unknown", f"one of {sorted(known)}", repr(name),
                             f"Attribute '{name}' is not an attribute of {c.name}")
            continue
        if not _attr_type_ok(view, a.type, value):
            yield view.issue(attr_at(name), f"{p}-attr-type", f"a {a.type}", f"{type(value).__name__} {value!r}",
                             f"Attribute '{name}' must be of type {a.type}")
            continue
        if a.allowed is not None:
            v = sval(value) if a.type == "string" else (ival(value) if a.type == "int" else fval(value))
            if v not in a.allowed:
                yield view.issue(attr_at(name), f"{p}-attr-allowed", f"one of {list(a.allowed)}", repr(v),
                                 f"Attribute '{name}' must be one of {list(a.allowed)}")
    for a in c.attributes:
        if a.required and a.name not in view.attrs:
            yield view.issue(attr_at(a.name), f"{p}-attr-required", f"attribute '{a.name}' set", "missing",
                             f"Attribute '{a.name}' is required")


def valid_attr(view: NodeView, name: str) -> bool:
    """True when the attribute (given or defaulted) has the contract's type and an allowed value."""
    a = view.contract.attr(name)
    value = view.a(name)
    if value is None or not _attr_type_ok(view, a.type, value):
        return False
    if a.allowed is None:
        return True
    v = sval(value) if a.type == "string" else (ival(value) if a.type == "int" else fval(value))
    return v in a.allowed


def head_count_rules(view: NodeView, p: str) -> Iterator[Issue]:
    nh, kv = int_attr(view, "num_heads"), int_attr(view, "kv_num_heads")
    if nh is not None and nh <= 0:
        yield view.issue(attr_at("num_heads"), f"{p}-num-heads-positive", "num_heads > 0", nh,
                         "Attribute 'num_heads' must be > 0")
    if kv is not None and kv <= 0:
        yield view.issue(attr_at("kv_num_heads"), f"{p}-kv-num-heads-positive", "kv_num_heads > 0", kv,
                         "Attribute 'kv_num_heads' must be > 0")
    if nh is not None and kv is not None and nh > 0 and kv > 0 and nh % kv != 0:
        yield view.issue(attr_at("num_heads"), f"{p}-num-heads-divisible", "num_heads % kv_num_heads == 0",
                         f"num_heads={nh}, kv_num_heads={kv}",
                         f"num_heads must be a multiple of kv_num_heads. Got num_heads % kv_num_heads == {nh % kv}")


def heads(view: NodeView) -> tuple[int | None, int | None]:
    """num_heads, kv_num_heads when valid (> 0 and divisible), else None each."""
    nh, kv = int_attr(view, "num_heads"), int_attr(view, "kv_num_heads")
    nh = nh if nh is not None and nh > 0 else None
    kv = kv if kv is not None and kv > 0 else None
    if nh is not None and kv is not None and nh % kv != 0:
        return None, None
    return nh, kv


def scalar_attr_rules(view: NodeView, p: str, epsilons: Iterable[str]) -> Iterator[Issue]:
    """scale, softcap, local_window_size, norm epsilons: the shared value ranges."""
    for name, rid in (("scale", "scale"), ("softcap", "softcap")):
        v = float_attr(view, name)
        if v is not None and not (math.isfinite(v) and v >= 0):
            yield view.issue(attr_at(name), f"{p}-{rid}", f"{name} finite and >= 0", v,
                             f"Attribute '{name}' must be finite and >= 0")
    w = int_attr(view, "local_window_size")
    if w is not None and w != -1 and w <= 0:
        yield view.issue(attr_at("local_window_size"), f"{p}-local-window", "-1 or > 0", w,
                         "Attribute 'local_window_size' must be -1 (off) or > 0")
    for name in epsilons:
        if name not in view.attrs and view.contract.attr(name).default is None:
            continue
        v = float_attr(view, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            yield view.issue(attr_at(name), f"{p}-norm-epsilon", f"{name} finite and > 0", v,
                             f"Attribute '{name}' must be finite and > 0")


# ------------------------------------------------------------------------------------------
# element types and ranks
# ------------------------------------------------------------------------------------------


def _all_tensors(view: NodeView):
    c = view.contract
    for idx, t in view.inputs.items():
        yield c.inputs[idx], t, inp(c.inputs[idx].name)
    for idx, t in (view.outputs or {}).items():
        yield c.outputs[idx], t, outp(c.outputs[idx].name)


def presence_rules(view: NodeView, p: str) -> Iterator[Issue]:
    """Required inputs present; output 0 named (when the requested outputs are known)."""
    c = view.contract
    for param in c.inputs:
        if not param.optional and param.index not in view.inputs:
            yield view.issue(inp(param.name), f"{p}-input-required", f"input {param.index} '{param.name}' present",
                             "absent", f"Input '{param.name}' (input {param.index}) is required")
    if view.outputs is not None:
        for param in c.outputs:
            if not param.optional and param.index not in view.outputs:
                yield view.issue(outp(param.name), f"{p}-output-required", f"output {param.index} '{param.name}' "
                                 "named", "absent", f"Output '{param.name}' (output {param.index}) is required")


def dtype_rules(view: NodeView, p: str) -> Iterator[Issue]:
    """Each tensor's element type is in its constraint; tensors of one type variable share one type."""
    c = view.contract
    bound: dict[str, tuple[str, str]] = {}  # var -> (type string, tensor name)
    for param, t, where in _all_tensors(view):
        if t.dtype is None:
            continue
        allowed = c.allowed_types(param)
        got = type_str(t.dtype)
        if got not in allowed:
            yield view.issue(where, f"{p}-dtype-allowed", f"one of {list(allowed)}", got,
                             f"{where.capitalize()} has element type {dtype_name(t.dtype)}, not allowed by "
                             f"type constraint {param.type_param}")
            continue
        var = param.type_param
        if var not in c.type_constraints or len(type_var_members(c)[var]) < 2 or len(allowed) < 2:
            continue
        if var not in bound:
            bound[var] = (got, param.name)
        elif bound[var][0] != got:
            ref_t, ref_name = bound[var]
            yield view.issue(where, f"{p}-dtype-same-{var}", f"{ref_t} (as '{ref_name}')", got,
                             f"Type parameter ({var}) bound to different types: '{param.name}' is "
                             f"{dtype_name(t.dtype)} but '{ref_name}' is {ref_t[7:-1]}")


def rank_rules(view: NodeView, p: str) -> Iterator[Issue]:
    for param, t, where in _all_tensors(view):
        r = t.rank
        if r is None or param.rank is None:
            continue
        allowed = param.rank if isinstance(param.rank, tuple) else (param.rank,)
        if r not in allowed:
            want = " or ".join(str(a) for a in allowed)
            yield view.issue(where, f"{p}-rank", f"rank {want}", f"rank {r} {shape_str(t)}",
                             f"{where.capitalize()} is expected to have {want} dimensions, got {r}")


def has_rank(t: TensorInfo | None, r: int) -> bool:
    """t is present and its rank is r or unknown (rank errors are reported by rank_rules)."""
    return t is not None and (t.rank is None or t.rank == r)
