"""Session-creation work: an ONNX graph compiled into steps, once.

1. compile: every node becomes a `Step` (op-table implementation or bound attention call); an op
   the runtime cannot run is reported here, all at once, with op type, domain and node name; so is a
   node input that nothing defines. Subgraphs (If branches) compile recursively; their free
   variables (names they read from the enclosing scopes) are recorded on the step that owns them.
2. fold: a step whose inputs are all constants runs once, on the host, and its outputs become
   constants (Constant nodes, shape arithmetic on initializers, weight casts).
   Attention nodes are validated here, once (the contract's static rules over the model's value_info:
   validators.validate_node; every issue of every node raised together as one ValidationError), and
   bound to the kernel variants that serve them (kernels/dispatch.py); runs then call the kernels
   without re-validating (InferenceSession(validate_inputs=True) re-checks concrete inputs per call).
3. place: a constant lives where its users read it: on the device for device ops; on the host
   (under the name `NAME::host`) for operands read on the host (Reshape shapes, Slice bounds,
   attention_metadata...) and for host ops (shape arithmetic whose dynamic inputs are all host
   values: Shape outputs, host graph inputs). Unused constants are dropped.
4. liveness: each step lists the values whose last use it is; the executor drops them after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from onnx.external_data_helper import uses_external_data

from ..kernels import dispatch
from ..validators.checks import validate_node
from ..validators.issues import Issue, ValidationError
from .ops import OpContext, has_host_outputs, host_inputs, lookup, node_attributes, normalize_domain
from .ops.packed import Packed
from .ops.registry import RUNTIME, prepacker
from .loading import read_external, release_data
from .ops.util import tensor_from_proto
from .steps import Graph, Step

ATTENTION_OPS = {("com.microsoft", "PagedAttention"), ("com.microsoft", "GroupQueryAttention")}
HOST = "::host"  # suffix of a constant's host copy
PACKED = "::packed"  # infix of a prepacked constant's name
_RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


@dataclass
class CompiledModel:
    graph: Graph
    attention_variants: dict[str, str]  # node -> the variant a run without a plan hint uses
    attention_calls: dict[str, dispatch.AttentionCall]  # node -> its bound call (serving variants, refusals)
    host_inputs: frozenset[str]
    cache_inputs: frozenset[str]
    const_storages: frozenset[int]  # storage addresses of host constants (run() never hands them out)
    host_const_ids: frozenset[int]  # id() of host constants (their device copies are cached)
    prepacked: dict[str, str] = field(default_factory=dict)  # step -> the layout its constants were given
    fused: dict[str, int] = field(default_factory=dict)  # fusion rule (fuse.py) -> rewrites it made


_SMALL_INT = 1 << 16  # integer initializers up to this many elements keep their values for shape inference


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without its weights (each float initializer becomes a typed graph input; small integer
    ones stay, for data propagation): ONNX shape inference on it takes milliseconds, not seconds."""
    sk = onnx.ModelProto(ir_version=model.ir_version)
    sk.opset_import.extend(model.opset_import)
    sk.functions.extend(model.functions)
    g, src = sk.graph, model.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(src.input)
    g.output.extend(src.output)
    g.value_info.extend(src.value_info)
    declared = {vi.name for vi in src.input}
    for t in src.initializer:
        if t.data_type in (TensorProto.INT32, TensorProto.INT64) and int(np.prod(t.dims)) <= _SMALL_INT:
            g.initializer.append(t)
        elif t.name not in declared:
            g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return sk


def static_facts(model: onnx.ModelProto) -> tuple[dict, dict]:
    """(value_info: tensor name -> (elem type, shape), integer constants) after ONNX shape inference with
    pagedkit's schemas, as validators.validate_model computes them (weights are not needed)."""
    from ..validators.model import _collect, _infer  # the validator's own inference and collection

    value_info, constants, _, _ = _collect(_infer(_skeleton(model)), None, True)
    return value_info, constants


def _has_attention(g: onnx.GraphProto) -> bool:
    for node in g.node:
        if (normalize_domain(node.domain), node.op_type) in ATTENTION_OPS:
            return True
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH and _has_attention(a.g):
                return True
    return False


class _Compiler:
    def __init__(self, model: onnx.ModelProto, device: torch.device, allow_fallback: bool,
                 capturable: bool = False, validate: bool = True, base_dir: str | None = None,
                 release: bool = False):
        self.model, self.device, self.allow_fallback = model, device, allow_fallback
        self.base_dir, self.release = base_dir, release
        self.capturable, self.validate = capturable, validate
        self.opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
        self.missing: list[str] = []
        self.errors: list[str] = []
        self.invalid: list[Issue] = []
        self.variants: dict[str, str] = {}
        self.calls: dict[str, dispatch.AttentionCall] = {}
        self.value_info, self.constants = static_facts(model) if _has_attention(model.graph) else ({}, {})

    def graph(self, proto: onnx.GraphProto, outer: set[str]) -> tuple[Graph, frozenset[str]]:
        """(compiled graph, its free variables)."""
        consts = {}
        for init in proto.initializer:
            if uses_external_data(init):
                if self.base_dir is None:
                    raise ValueError(f"initializer '{init.name}': external data without the model's folder")
                consts[init.name] = read_external(init, self.base_dir)
            else:
                consts[init.name] = tensor_from_proto(init)
            if self.release:  # the session owns the proto: its copy of the weight goes now
                release_data(init)
        if len(proto.sparse_initializer):
            self.errors.append(f"graph '{proto.name}': sparse initializers are not supported")
        local = {vi.name for vi in proto.input} | set(consts)
        steps, free = [], set()
        for node in proto.node:
            step = self.step(node, outer | local)
            for n in step.inputs:
                if n and n not in local:
                    if n in outer:
                        free.add(n)
                    else:
                        self.errors.append(f"node '{step.name}' ({step.op_type}): input '{n}' is not a graph input, "
                                           "an initializer or the output of an earlier node")
            free |= {n for n in step.free_vars if n not in local}
            local |= {n for n in step.outputs if n}
            steps.append(step)
        for o in proto.output:
            if o.name not in local:
                (free.add(o.name) if o.name in outer else
                 self.errors.append(f"graph output '{o.name}' is not produced by the graph"))
        return Graph(steps, [vi.name for vi in proto.input], [o.name for o in proto.output], consts), frozenset(free)

    def step(self, node: onnx.NodeProto, scope: set[str]) -> Step:
        domain = normalize_domain(node.domain)
        name = node.name or f"{node.op_type}({', '.join(node.output)})"
        step = Step(name, node.op_type, domain, list(node.input), list(node.output), node_attributes(node))
        if (domain, node.op_type) in ATTENTION_OPS:
            if self.validate:  # once, here: runs call the kernels with validate=False
                issues = validate_node(node, self.value_info, self.constants)
                if issues:
                    self.invalid += issues
                    return step
            try:
                step.call = dispatch.bind(node, self.model, self.device, self.allow_fallback,
                                          value_info=self.value_info, capturable=self.capturable)
            except (NotImplementedError, ValueError) as exc:
                self.missing.append(str(exc))
                return step
            self.variants[name] = step.call.name
            self.calls[name] = step.call
            step.host_in = dispatch.host_input_indices(node.op_type)
            step.cache_in = dispatch.cache_input_indices(node.op_type)
            return step
        try:
            step.impl = lookup(domain, node.op_type, self.opsets.get(domain, 1), name)
            step.host_in = host_inputs(domain, node.op_type)
            step.host_out = has_host_outputs(domain, node.op_type)
        except NotImplementedError as exc:
            self.missing.append(str(exc).split("; supported ops")[0])
        free = set()
        for key, value in list(step.attrs.items()):
            if isinstance(value, onnx.GraphProto):
                step.attrs[key], sub_free = self.graph(value, scope)
                free |= sub_free
            elif isinstance(value, list) and value and isinstance(value[0], onnx.GraphProto):
                self.errors.append(f"node '{name}' ({node.op_type}): attribute '{key}' holds a list of graphs, "
                                   "which the runtime does not run")
        step.free_vars = frozenset(free)
        step.ctx = OpContext(opset=self.opsets.get(domain, 1), node_name=name, num_outputs=len(node.output),
                             requested=tuple(bool(o) for o in node.output),
                             device=self.device)
        return step


def _fold(g: Graph) -> None:
    """Run once, on the host, every step whose inputs are all constants; its outputs become constants."""
    kept = []
    cpu = torch.device("cpu")
    for step in g.steps:
        foldable = (step.call is None and not step.has_subgraph and step.op_type not in _RANDOM_OPS
                    and all((not n) or n in g.consts for n in step.inputs))
        if not foldable:
            kept.append(step)
            continue
        try:
            outs = step.impl([g.consts[n] if n else None for n in step.inputs], step.attrs, replace(step.ctx, device=cpu))
        except Exception as exc:
            raise ValueError(f"node '{step.name}' ({step.op_type}) fails on its constant inputs: {exc}") from exc
        for n, t in zip(step.outputs, outs):
            if n and t is not None:
                g.consts[n] = t
    g.steps = kept


def _sole_owner(t: Any, holders: dict[int, int]) -> bool:
    """t is a tensor holding all of its storage, shared with no other constant (a folded view of another
    weight is not: taking it apart would spoil that one). holders: storage address -> constants on it."""
    if not isinstance(t, torch.Tensor) or t.storage_offset() != 0:
        return False
    st = t.untyped_storage()
    return st.nbytes() == t.numel() * t.element_size() and holders.get(st.data_ptr(), 0) == 1


def _prepack(g: Graph, device: torch.device) -> dict[str, str]:
    """Lay out constant inputs once for their kernels (registry.prepack), in this graph and its subgraphs:
    each replacement becomes a constant of its own, and an original is dropped as soon as no step reads it
    any more (so at most one weight is held twice, briefly). Returns {step name: the layout given}."""
    report: dict[str, str] = {}
    made: dict[tuple, str] = {}  # (input, op, attrs) -> name of its replacement (a weight shared by two nodes)
    readers: dict[str, int] = {}
    for s in g.steps:
        for n in list(s.inputs) + list(s.free_vars):
            readers[n] = readers.get(n, 0) + 1
    for n in g.outputs:
        readers[n] = readers.get(n, 0) + 1
    holders: dict[int, int] = {}
    for c in g.consts.values():
        if isinstance(c, torch.Tensor):
            ptr = c.untyped_storage().data_ptr()
            holders[ptr] = holders.get(ptr, 0) + 1
    for step in g.steps:
        for value in step.attrs.values():
            if isinstance(value, Graph):
                report.update(_prepack(value, device))
        fn = prepacker(step.domain, step.op_type) if step.impl is not None else None
        if fn is None:
            continue
        ins = [(g.consts[n] if n in g.consts else RUNTIME) if n else None for n in step.inputs]
        key_attrs = tuple(sorted((k, v) for k, v in step.attrs.items() if isinstance(v, (int, float, str))))
        consumable = frozenset(i for i, n in enumerate(step.inputs)
                               if n in g.consts and readers.get(n, 0) == 1 and n not in g.outputs
                               and _sole_owner(g.consts[n], holders))
        for i, new in fn(ins, step.attrs, replace(step.ctx, device=device, consumable=consumable)).items():
            name = step.inputs[i]
            key = (name, step.op_type, key_attrs)
            if key not in made:
                made[key] = f"{name}{PACKED}{len(made)}"
                g.consts[made[key]] = new
            step.inputs[i] = made[key]
            done = g.consts[made[key]]
            desc = done.describe() if isinstance(done, Packed) else f"{type(done).__name__} {getattr(done, 'dtype', '')}"
            report[step.name] = f"{report[step.name]}; {desc}" if step.name in report else desc
            readers[name] -= 1
            if readers[name] == 0:
                g.consts.pop(name, None)
    return report


def _host_graph_inputs(g: Graph) -> frozenset[str]:
    """Graph inputs that every user reads on the host (and that have a user)."""
    uses: dict[str, list[bool]] = {}
    for step in g.steps:
        for i, n in enumerate(step.inputs):
            if n in g.inputs:
                uses.setdefault(n, []).append(i in step.host_in)
        for n in step.free_vars:
            if n in g.inputs:
                uses.setdefault(n, []).append(False)
    return frozenset(n for n, u in uses.items() if all(u))


def _cache_graph_inputs(g: Graph) -> frozenset[str]:
    return frozenset(step.inputs[i] for step in g.steps for i in step.cache_in
                     if i < len(step.inputs) and step.inputs[i] in g.inputs)


def _place(g: Graph, chain: list[Graph], host_vals: set[str], uses: dict, rewrite: bool) -> None:
    """Record where each constant is read (uses[(id(owner), name)] ⊆ {"host", "device"}) and point
    host reads at the host copy. chain: the enclosing graphs, innermost last."""
    scopes = chain + [g]

    def owner(n: str) -> Graph | None:
        return next((s for s in reversed(scopes) if n in s.consts), None)

    for step in g.steps:
        dyn = [n for i, n in enumerate(step.inputs) if n and i not in step.host_in and owner(n) is None]
        on_host = step.call is None and not step.has_subgraph and bool(dyn) and all(n in host_vals for n in dyn)
        for i, n in enumerate(step.inputs):
            o = owner(n) if n else None
            if o is None:
                continue
            kind = "host" if (i in step.host_in or on_host) else "device"
            uses.setdefault((id(o), n), set()).add(kind)
            if kind == "host" and rewrite:
                step.inputs[i] = n + HOST
        if on_host or step.host_out:
            host_vals.update(n for n in step.outputs if n)
        for value in step.attrs.values():
            if isinstance(value, Graph):
                _place(value, scopes, set(host_vals), uses, rewrite)
    for n in g.outputs:
        o = owner(n)
        if o is not None:
            uses.setdefault((id(o), n), set()).add("device")


def _materialize(g: Graph, uses: dict, device: torch.device) -> None:
    """Keep each constant where it is read; drop the unread ones."""
    consts = {}
    for n, t in g.consts.items():
        if isinstance(t, Packed):  # laid out for its kernel on the run device already
            consts[n] = t
            continue
        kinds = uses.get((id(g), n), set())
        if "device" in kinds:
            consts[n] = t.to(device)
        if "host" in kinds:
            consts[n + HOST if device.type != "cpu" else n] = t
    g.consts = consts
    for step in g.steps:
        for value in step.attrs.values():
            if isinstance(value, Graph):
                _materialize(value, uses, device)


def _liveness(g: Graph) -> None:
    """step.release: values produced in this graph (or fed to it) whose last reader is the step."""
    keep = set(g.outputs)
    last: dict[str, int] = {}
    for i, step in enumerate(g.steps):
        for n in list(step.inputs) + list(step.free_vars):
            if n:
                last[n] = i
        for n in step.outputs:
            if n and n not in last:
                last[n] = i  # never read later: dead right after it is made
        for value in step.attrs.values():
            if isinstance(value, Graph):
                _liveness(value)
    local = set(g.inputs) | {n for s in g.steps for n in s.outputs if n}
    for n, i in last.items():
        if n in local and n not in keep and n not in g.consts:
            g.steps[i].release.append(n)


def _all_consts(g: Graph):
    yield from g.consts.items()
    for step in g.steps:
        for value in step.attrs.values():
            if isinstance(value, Graph):
                yield from _all_consts(value)


def compile_model(model: onnx.ModelProto, device: torch.device, allow_reference_fallback: bool = True, *,
                  capturable: bool = False, validate: bool = True, base_dir: str | None = None,
                  release_initializers: bool = False) -> CompiledModel:
    """Compile the model's graph for `device`; raises NotImplementedError listing every op it cannot
    run (attention nodes no kernel variant serves included), ValidationError listing every contract
    issue of every attention node (validate=True), ValueError for a malformed graph.
    base_dir: where initializers left in external data are read from (load_model(lazy_weights=True));
    release_initializers: clear each initializer's data from the proto once converted (a proto the caller
    owns: the weights are then held once, as tensors)."""
    comp = _Compiler(model, device, allow_reference_fallback, capturable, validate, base_dir, release_initializers)
    g, free = comp.graph(model.graph, set())
    if free:
        comp.errors.append(f"names read but never defined: {sorted(free)}")
    if comp.missing:
        raise NotImplementedError("pagedkit cannot run these ops: " + "; ".join(comp.missing))
    if comp.invalid:
        raise ValidationError(comp.invalid, "invalid attention node(s) at session creation")
    if comp.errors:
        raise ValueError("invalid model: " + "; ".join(comp.errors))
    _fold(g)
    from .fuse import fuse, token_logits

    fused = fuse(g, logits=token_logits(model.graph), device=device)
    prepacked = _prepack(g, device)
    host_in = _host_graph_inputs(g)
    uses: dict = {}
    _place(g, [], set(host_in), uses, rewrite=device.type != "cpu")
    _materialize(g, uses, device)
    _liveness(g)
    host_consts = [t for n, t in _all_consts(g) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
    return CompiledModel(
        graph=g, attention_variants=comp.variants, attention_calls=comp.calls, host_inputs=host_in, prepacked=prepacked,
        fused=fused,
        cache_inputs=_cache_graph_inputs(g),
        const_storages=frozenset(t.untyped_storage().data_ptr() for t in host_consts if t.numel()),
        host_const_ids=frozenset(id(t) for t in host_consts) if device.type != "cpu" else frozenset())
