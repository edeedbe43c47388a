"""ONNX schemas and type/shape inference (design §16) for com.microsoft PagedAttention and GroupQueryAttention.

`register_schemas()` registers both operators with onnx (`onnx.defs.register_schema`), built from the
contract data in contract.py, when the installed onnx lacks them, so that
`onnx.shape_inference.infer_shapes(model, strict_mode=True)` works on models containing our nodes.
The attached inference hook and the pure-python `infer_node_outputs(...)` share one implementation.

Tensor types are `(elem_type, shape)`: elem_type an ONNX TensorProto value (int) or None when unknown;
shape a tuple of dims (int known, str symbolic, None unknown) or None when even the rank is unknown.

The rules (a dim is computed only from known values; otherwise it stays symbolic or unknown, never an
error; inference never validates — that is the validator's job):

PagedAttention
  output 0 ([T, H*Dv]): element type of query. LATENT: (T, num_heads * v_head_size) when v_head_size is set,
    else query's shape. SEPARATE packed QKV (key and value absent): (T, num_heads * head_size) with
    head_size = query.shape[1] / (num_heads + 2 * kv_num_heads) when that divides, else (T, unknown).
    SEPARATE unpacked: query's shape (the shipped propagateShapeFromInputToOutput(0 -> 0)).
  outputs 1/2 take type and shape from inputs 3/4 (key_cache / value_cache, never from query);
  outputs 3/4 from inputs 17/18 (scale caches); an output whose source input is absent is left alone.
  output 5 (output_qk): (num_heads, T, block_table.shape[1] * key_cache.shape[1]); element type float
    unless the graph declares one of QK's types. Through onnx the hook cannot see declared types, so
    there it sets only the shape and the declared type stands: declare output_qk's type in the graph
    (graph outputs always are); undeclared, onnx records it with an UNDEFINED element type.
GroupQueryAttention (onnxruntime's bert_defs.cc logic, with "unknown" wherever ORT would guess)
  output 0: query's shape unpacked; packed QKV (B, S, num_heads * head_size).
  present_key/value (1/2): with past: type of past_key/past_value, shape (B, Hkv, L, past dim 3) with
    L = past capacity when sliding_window_cache=1, else max(past length, total_sequence_length) when both
    are known (total from a constant), else unknown. Without past: query's type and
    (B, kv_num_heads, total_sequence_length, head_size); type and head dim unknown for quantized caches.
  output_qk (3): query's type, (B, num_heads, S, total_sequence_length).
"""

from __future__ import annotations

import threading
from typing import Any, Mapping, Sequence

import numpy as np

from .contract import CONTRACTS, OpContract, get_contract
from .nodeview import Dim, dtype_from_type_str, known

Shape = tuple[Dim, ...] | None
TensorType = tuple[int | None, Shape]
_UNKNOWN: TensorType = (None, None)
_FLOAT = 1  # onnx.TensorProto.FLOAT


# ------------------------------------------------------------------------------------------------
# Small arithmetic on dims: a result is known only when every operand is a known positive int.
# ------------------------------------------------------------------------------------------------

def _pos(x: Any) -> int | None:
    return x if known(x) and x > 0 else None


def _mul(a: Dim, b: Dim) -> int | None:
    a, b = _pos(a), _pos(b)
    return a * b if a is not None and b is not None else None


def _div(a: Dim, b: Dim) -> int | None:
    """a / b when both are known, positive and b divides a; else None."""
    a, b = _pos(a), _pos(b)
    return a // b if a is not None and b is not None and a % b == 0 else None


def _dim(t: TensorType | None, i: int) -> Dim:
    if t is None or t[1] is None or i >= len(t[1]):
        return None
    return t[1][i]


def _shape_of_rank(t: TensorType | None, rank: int) -> Shape:
    return t[1] if t is not None and t[1] is not None and len(t[1]) == rank else None


# ------------------------------------------------------------------------------------------------
# The one implementation: PagedAttention and GroupQueryAttention outputs from inputs and attributes.
# ------------------------------------------------------------------------------------------------

def _infer_paged(a: Mapping[str, Any], ins: Mapping[int, TensorType], qk_elem: int | None) -> dict[int, TensorType]:
    nh, kvh = _pos(a.get("num_heads")), _pos(a.get("kv_num_heads"))
    query = ins.get(0)
    q = _shape_of_rank(query, 2)  # [T, H*D] or packed [T, (H + 2*Hkv)*D]
    out0: Shape = None
    if q is not None:
        tokens, width = q
        if a.get("kv_cache_layout") == "LATENT":
            # LATENT reads the layout before Q/K/V presence: unpacked formula, V is the latent's prefix.
            v_head_size = _pos(a.get("v_head_size"))
            out_width = _mul(nh, v_head_size) if v_head_size else width
        elif 1 not in ins and 2 not in ins:  # SEPARATE packed QKV
            divisor = nh + 2 * kvh if nh and kvh else None
            out_width = _mul(nh, _div(width, divisor))
        else:  # SEPARATE unpacked: the shipped 0 -> 0 propagation (no numeric dim needed)
            out_width = width
        out0 = (tokens, out_width)
    res: dict[int, TensorType] = {0: (query[0] if query else None, out0)}
    # In-place cache outputs alias their cache inputs: type AND shape from inputs 3/4/17/18.
    for out_idx, in_idx in ((1, 3), (2, 4), (3, 17), (4, 18)):
        if in_idx in ins:
            res[out_idx] = ins[in_idx]
    # output_qk [H, T, MB*BS]
    capacity = _mul(_dim(ins.get(7), 1), _dim(ins.get(3), 1))
    res[5] = (qk_elem, (nh, q[0] if q else None, capacity))
    return res


def _infer_gqa(a: Mapping[str, Any], ins: Mapping[int, TensorType], vals: Mapping[int, np.ndarray]
               ) -> dict[int, TensorType]:
    nh, kvh = _pos(a.get("num_heads")), _pos(a.get("kv_num_heads"))
    query = ins.get(0)
    q_elem = query[0] if query else None
    q = _shape_of_rank(query, 3)  # [B, S, H*D] or packed [B, S, (H + 2*Hkv)*D]
    batch = seq = head_size = None
    out0: Shape = None
    if q is not None:
        batch, seq, width = q
        if 1 not in ins and 2 not in ins:  # packed QKV
            head_size = _div(width, nh + 2 * kvh if nh and kvh else None)
            out0 = (batch, seq, _mul(nh, head_size))
        else:
            head_size = _div(width, nh)
            out0 = q
    res: dict[int, TensorType] = {0: (q_elem, out0)}

    total = None  # total_sequence_length, when a constant
    if 6 in vals and np.asarray(vals[6]).size == 1:
        total = _pos(int(np.asarray(vals[6]).reshape(-1)[0]))
    window_cache = a.get("sliding_window_cache") == 1
    if 3 in ins or 4 in ins:
        for out_idx, past_idx in ((1, 3), (2, 4)):
            if past_idx not in ins:
                continue
            p_elem, _ = ins[past_idx]
            p = _shape_of_rank(ins[past_idx], 4)  # [B, Hkv, L_past, D or (D+1)/2]
            present: Shape = None
            if p is not None:
                if window_cache:  # fixed window buffer: present keeps the past capacity
                    length = p[2]
                elif total and known(p[2]):  # shared buffer: capacity; separate: past + new = total
                    length = max(total, p[2])
                else:
                    length = None
                present = (p[0], p[1], length, p[3])
            res[out_idx] = (p_elem, present)
    else:  # no past: present holds the total sequence, in query's type unless the cache is quantized
        quantized = bool(a.get("kv_cache_bit_width")) or a.get("k_quant_type", "NONE") != "NONE" \
            or a.get("v_quant_type", "NONE") != "NONE"
        length = None if window_cache else total
        present = (batch, kvh, length, None if quantized else head_size)
        res[1] = res[2] = (None if quantized else q_elem, present)
    res[3] = (q_elem, (batch, nh, seq, total))  # output_qk [B, H, S, total]
    return res


def _infer(contract: OpContract, attrs: Mapping[str, Any], ins: Mapping[int, TensorType],
           vals: Mapping[int, np.ndarray], qk_elem: int | None) -> dict[int, TensorType]:
    a = {**contract.defaults(), **{k: _plain(v) for k, v in attrs.items()}}
    if contract.name == "PagedAttention":
        return _infer_paged(a, ins, qk_elem)
    return _infer_gqa(a, ins, vals)


def _plain(v: Any) -> Any:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else v


def _index(contract: OpContract, key: int | str, kind: str) -> int:
    params = contract.inputs if kind == "input" else contract.outputs
    if isinstance(key, int) and not isinstance(key, bool):
        if 0 <= key < len(params):
            return key
        raise ValueError(f"{contract.name} has no {kind} index {key}; valid: 0..{len(params) - 1}")
    names = [p.name for p in params]
    if key not in names:
        raise ValueError(f"{contract.name} has no {kind} named {key!r}; valid: {names}")
    return names.index(key)


def _by_index(contract: OpContract, given: Mapping | Sequence | None, kind: str) -> dict[int, Any]:
    if given is None:
        return {}
    items = given.items() if isinstance(given, Mapping) else enumerate(given)
    return {_index(contract, k, kind): v for k, v in items if v is not None}


def _norm_type(t: Any) -> TensorType:
    elem, shape = t
    if shape is not None:
        shape = tuple(int(d) if isinstance(d, (int, np.integer)) and not isinstance(d, bool) else d
                      for d in shape)
    return (None if elem in (None, 0) else int(elem)), shape


def infer_node_outputs(
    op_type: str,
    attrs: Mapping[str, Any],
    input_types: Mapping[str | int, TensorType | None] | Sequence[TensorType | None],
    *,
    outputs: Sequence[str | int] | None = None,
    input_values: Mapping[str | int, Any] | None = None,
    declared_output_types: Mapping[str | int, int | None] | None = None,
) -> dict[int, TensorType]:
    """Output types of one PagedAttention / GroupQueryAttention node (design §16), without onnx.

    input_types: by ONNX input name or index (or a list by index), each `(elem_type, shape)`; None or
    missing = absent input. attrs: the node's attributes (contract defaults fill the rest).
    outputs: the requested outputs by name or index (default: all of the contract's).
    input_values: integer contents known statically (GQA total_sequence_length).
    declared_output_types: element types the graph declares (PagedAttention output_qk takes one of QK's).
    Returns {output index: (elem_type, shape)}; (None, None) where nothing is known.
    """
    contract = get_contract(op_type)
    ins = {i: _norm_type(t) for i, t in _by_index(contract, input_types, "input").items()}
    vals = {i: np.asarray(v) for i, v in _by_index(contract, input_values, "input").items()}
    declared = _by_index(contract, declared_output_types, "output")
    qk_elem = _FLOAT
    if contract.name == "PagedAttention":
        qk_types = {dtype_from_type_str(s) for s in contract.allowed_types(contract.outputs[5])}
        qk_elem = declared[5] if declared.get(5) in qk_types else _FLOAT
    wanted = range(len(contract.outputs)) if outputs is None else [_index(contract, o, "output") for o in outputs]
    res = _infer(contract, attrs, ins, vals, qk_elem)
    return {i: res.get(i, _UNKNOWN) for i in wanted}


# ------------------------------------------------------------------------------------------------
# onnx: schemas built from the contract, with the inference above as their hook.
# ------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()


def type_of_proto(tp: Any) -> TensorType:
    if tp is None or not tp.HasField("tensor_type"):
        return _UNKNOWN
    tt = tp.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param if d.HasField("dim_param") else None)
                      for d in tt.shape.dim)
    return (tt.elem_type or None), shape


def _to_type_proto(t: TensorType):
    import onnx

    elem, shape = t
    tp = onnx.TypeProto()
    tp.tensor_type.elem_type = elem or 0  # type is set together with (so before) the shape
    if shape is not None:
        dims = tp.tensor_type.shape
        dims.SetInParent()
        for d in shape:
            dim = dims.dim.add()
            if known(d):
                dim.dim_value = d
            elif isinstance(d, str) and d:
                dim.dim_param = d
    return tp


def _onnx_hook(contract: OpContract):
    def infer(ctx) -> None:
        from onnx import TensorProto, helper, numpy_helper

        ins: dict[int, TensorType] = {}
        vals: dict[int, np.ndarray] = {}
        for i in range(min(ctx.get_num_inputs(), len(contract.inputs))):
            if not ctx.has_input(i):  # empty name: absent optional input
                continue
            ins[i] = type_of_proto(ctx.get_input_type(i))
            data = ctx.get_input_data(i)
            if data is not None and data.data_type in (TensorProto.INT32, TensorProto.INT64):
                vals[i] = numpy_helper.to_array(data)
        attrs = {}
        for a in contract.attributes:
            proto = ctx.get_attribute(a.name)
            if proto is not None:
                attrs[a.name] = helper.get_attribute_value(proto)
        # The hook cannot see declared output types, so PagedAttention's output_qk gets its shape only
        # and the graph's declared type stands. Any other output is set only with a known element type
        # (an UNDEFINED element type in value_info makes onnxruntime refuse the model).
        res = _infer(contract, attrs, ins, vals, qk_elem=None)
        shape_only = 5 if contract.name == "PagedAttention" else None
        for i in range(min(ctx.get_num_outputs(), len(contract.outputs))):
            elem, shape = res.get(i, _UNKNOWN)
            if ctx.has_output(i) and (elem is not None or (i == shape_only and shape is not None)):
                ctx.set_output_type(i, _to_type_proto((elem, shape)))

    return infer


def _schema_of(contract: OpContract):
    from onnx import defs, helper

    S = defs.OpSchema
    attr_types = {"int": S.AttrType.INT, "float": S.AttrType.FLOAT, "string": S.AttrType.STRING}
    cast = {"int": int, "float": float, "string": str}

    def param(p) -> S.FormalParameter:
        option = S.FormalParameterOption.Optional if p.optional else S.FormalParameterOption.Single
        return S.FormalParameter(p.name, p.type_param, f"{p.shape}. {p.description}", param_option=option)

    def attribute(a) -> S.Attribute:
        if a.default is None:
            return S.Attribute(a.name, attr_types[a.type], a.description, required=a.required)
        proto = helper.make_attribute(a.name, cast[a.type](a.default), attr_type=int(attr_types[a.type].value))
        return S.Attribute(a.name, proto, a.description)

    doc = contract.summary + "".join(f"\n\n{head}: {text}" for head, text in contract.semantics)
    schema = S(
        contract.name, contract.domain, contract.since_version, doc,
        inputs=[param(p) for p in contract.inputs],
        outputs=[param(p) for p in contract.outputs],
        type_constraints=[(k, list(v), contract.type_constraint_docs.get(k, ""))
                          for k, v in contract.type_constraints.items()],
        attributes=[attribute(a) for a in contract.attributes],
    )
    schema.set_type_and_shape_inference_function(_onnx_hook(contract))
    return schema


def register_schemas() -> list[str]:
    """Register PagedAttention and GroupQueryAttention (com.microsoft) with onnx where it lacks them.

    Idempotent and thread-safe; returns the op types registered by this call ([] when both exist).
    A schema that onnx already has (from onnx itself or an earlier call) is left as it is.
    """
    from onnx import defs

    added = []
    with _LOCK:
        for contract in CONTRACTS.values():
            if not defs.has(contract.name, contract.domain):
                defs.register_schema(_schema_of(contract))
                added.append(contract.name)
    return added
