"""The machinery both node-level rule sets share (node_rules/__init__.py says what a rule set is): the source
node's facts (`NodeFacts`), the node being built (`Target`), `Rule`, running a rule set (`run_rules`: every
check, then every rewrite; `Refused` with every reason), building and validating the target node (`make_node`,
`convert`), and the rules both directions apply alike (attributes spelled the same way, the attention_bias /
softcap order, the activation dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_ir as ir

from pagedkit.validators import validate_node
from pagedkit.validators.contract import DOMAIN, OpContract

from ...kernels.onnx_ops.builder import Builder

F16, BF16, F32, I32, I64 = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.INT32,
                            ir.DataType.INT64)
PAGED_T = (F16, BF16)  # PagedAttention's T (contract-decisions §6)


class Refused(Exception):
    """A node a rule set does not convert; the message gives every reason."""


# ------------------------------------------------------------------------------------------------
# facts of a node, the target being built, rules
# ------------------------------------------------------------------------------------------------

@dataclass
class NodeFacts:
    """One source node: attributes (contract defaults filled in), present inputs and outputs by contract name."""

    name: str
    contract: OpContract
    attrs: dict
    inputs: dict  # contract input name -> ir.Value
    outputs: dict  # contract output name -> ir.Value (named outputs only)
    given: frozenset  # attribute names written on the node

    @classmethod
    def of(cls, node: ir.Node, contract: OpContract) -> "NodeFacts":
        attrs = {k: (v.value.decode() if isinstance(v.value, bytes) else v.value) for k, v in node.attributes.items()}
        ins = {n: v for n, v in zip(contract.input_names, node.inputs) if v is not None}
        outs = {n: v for n, v in zip(contract.output_names, node.outputs) if v is not None and v.name}
        return cls(node.name or contract.name, contract, contract.defaults() | attrs, ins, outs, frozenset(attrs))


@dataclass
class Target:
    """The node being built: attributes, inputs / outputs by contract name, helper nodes on `b`."""

    contract: OpContract
    b: Builder
    attrs: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)  # name -> ir.Value
    outputs: dict = field(default_factory=dict)  # name -> ir.Value (new values of the created node)
    after: list = field(default_factory=list)  # callables(node) run once the node exists (output adapters)
    replaces: dict = field(default_factory=dict)  # source output value -> the value that replaces it


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Callable[[NodeFacts], bool]
    check: Callable[[NodeFacts, object], str | None]
    rewrite: Callable[[NodeFacts, Target, object], None]


def _always(f):
    return True


def _ok(f, io):
    return None


def _dtype(v: ir.Value | None) -> ir.DataType | None:
    return None if v is None or v.dtype is None else v.dtype


def _dims(v: ir.Value | None) -> tuple | None:
    if v is None or v.shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in v.shape)


def _value_info(values) -> dict:
    info = {}
    for v in values:
        if v is None or not v.name:
            continue
        shape = None if v.shape is None else tuple(d if isinstance(d, int) else (str(d) if d is not None and
                                                                                  str(d) else None) for d in v.shape)
        info[v.name] = (int(v.dtype) if v.dtype is not None else None, shape)
    return info


def _const_ints(values) -> dict:
    out = {}
    for v in values:
        if v is not None and v.const_value is not None and v.dtype in (I32, I64):
            try:
                out[v.name] = v.const_value.numpy()
            except Exception:
                pass
    return out


def _new_value(name: str, dtype: ir.DataType | None, shape) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype) if dtype is not None else None,
                    shape=ir.Shape(shape) if shape is not None else None)


def run_rules(rules: tuple[Rule, ...], f: NodeFacts, t: Target, io) -> list[str]:
    """Apply a rule set: every check first (all reasons collected), then every rewrite. Returns the names of
    the rules that matched; raises Refused with every reason when a check fails."""
    matched = [r for r in rules if r.pattern(f)]
    reasons = [f"{r.name}: {why}" for r in matched if (why := r.check(f, io))]
    if reasons:
        raise Refused("; ".join(reasons))
    for r in matched:
        r.rewrite(f, t, io)
    return [r.name for r in matched]


def make_node(t: Target, name: str) -> ir.Node:
    """The attention node of `t`, validated by pagedkit's validator (Refused with the issues otherwise)."""
    c = t.contract
    ins = [t.inputs.get(n) for n in c.input_names]
    while ins and ins[-1] is None:
        ins.pop()
    outs = []
    last = max(i for i, n in enumerate(c.output_names) if n in t.outputs)
    for n in c.output_names[: last + 1]:
        outs.append(t.outputs.get(n) or ir.Value(name=""))
    attrs = {k: v for k, v in t.attrs.items() if c.attr(k).default is None or v != c.attr(k).default}
    node = ir.Node(DOMAIN, c.name, ins, ir.convenience.convert_attributes(attrs), outputs=outs, name=name)
    proto = ir.serde.serialize_node(node)
    issues = validate_node(proto, _value_info([*ins, *outs]), _const_ints(ins))
    if issues:
        raise Refused(f"the created {c.name} node is invalid: " + "; ".join(str(i) for i in issues[:6]))
    for fn in t.after:
        fn(node)
    return node


# ------------------------------------------------------------------------------------------------
# shared rules: attributes both operators spell the same way
# ------------------------------------------------------------------------------------------------

SAME_ATTRS = ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary",
              "rotary_interleaved", "qk_norm_epsilon", "qk_output")
PASS_INPUTS = ("cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight")


def _copy_same(f, t, io):
    for k in SAME_ATTRS:
        if k in f.given:
            t.attrs[k] = f.attrs[k]


def _bias_softcap_check(f, io):
    if "attention_bias" in f.inputs and float(f.attrs.get("softcap", 0.0)) > 0:
        return ("attention_bias with softcap > 0: GroupQueryAttention adds the bias after softcap, PagedAttention "
                "before it; the converted node would compute something else")
    return None


def _activation_check(target_is_paged: bool):
    def check(f, io):
        dt = _dtype(f.inputs["query"])
        if dt is None:
            return "the element type of 'query' is unknown (run shape inference first)"
        if target_is_paged and dt not in PAGED_T and not getattr(io, "cast_to", None):
            return (f"query is {dt.name}; PagedAttention's T is float16 / bfloat16 only (contract-decisions §6): "
                    "pass cast_to=FLOAT16 to put Casts around the node")
        return None
    return check


def _np_dtype(dt: ir.DataType):
    return dt.numpy() if dt is not None else np.float32


def _refuse(reason):
    return lambda f, io: reason


def _renamed(name: str, old: str, new: str) -> str:
    """The builder's node names end in the op type ('/model/layers.0/attn/GroupQueryAttention'): swap it."""
    return name[: -len(old)] + new if name.endswith(old) else f"{name}/{new}"


def convert(node: ir.Node, io, rules: tuple[Rule, ...], src, dst, tag: str) -> tuple[list, dict, list]:
    """Run `rules` on one node of op `src`, build the `dst` node: (nodes before it, it, nodes after it)."""
    f = NodeFacts.of(node, src)
    t = Target(dst, Builder(f"{f.name}/{tag}"))
    applied = run_rules(rules, f, t, io)
    pre = list(t.b.nodes)
    t.b.tape = ir.tape.Tape()
    attn = make_node(t, _renamed(f.name, src.name, dst.name))
    return [*pre, attn, *t.b.nodes], t.replaces, applied
