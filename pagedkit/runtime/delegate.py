"""CPU plan option: the model runs in onnxruntime's CPU execution provider (MLAS GEMMs, its int4 MatMulNBits, its
fusions, no per-op Python) with the paged semantics kept. onnxruntime has no CPU PagedAttention, so:

1. `delegate` first rewrites every PagedAttention node it can into standard ops with in-place cache writes
   (kernels/onnx_ops, decompose(in_place=True)): each cache output is a ScatterND on its cache input, and
   Segment.run binds that output to the input's buffer, so a step writes only its own rows.
2. `partition` cuts the graph at the barriers: PagedAttention nodes left as they are, nodes holding subgraphs
   (If / Loop / Scan: pagedkit resolves their outer-scope names) and nodes of domains onnxruntime does not
   know. Every other node gets a level: the largest level of its inputs, where a barrier's outputs are one
   level above the barrier. The non-barrier nodes of one level form segment L, which runs before the
   barriers of level L: a barrier of level L reads only values of level <= L, and no barrier of level L
   reads another's outputs. GroupQueryAttention is no barrier (onnxruntime's CPU kernel is its reference).
3. each segment becomes one onnxruntime session (typed boundaries from ONNX shape inference, then from
   what onnxruntime infers; initializers only segments read move into them, so pagedkit never loads them)
   and one `pagedkit.ort::Segment` node in the returned model (implementation: runtime/ops/control.py).

A segment onnxruntime refuses (an op or type it lacks), whose boundary holds a type numpy lacks (bfloat16) or
that holds over 2 GB of weights stays with pagedkit's own kernels; if it held a rewritten attention node, the
rewrite is dropped for the whole model. `DelegationReport` (InferenceSession.delegated) says which and why.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import onnx
import torch
from onnx import TensorProto, helper
from onnx.external_data_helper import uses_external_data

from .graph import static_facts
from .ops.collectives import COLLECTIVE_OPS
from .ops.control import SEGMENTS
from .ops.registry import ORT_DOMAIN, normalize_domain

SEGMENT_OP = "Segment"
_KNOWN_DOMAINS = {"", "com.microsoft"}
_NUMPY_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.INT8, TensorProto.UINT8,
                TensorProto.INT16, TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL}
_ORT_TYPES = {f"tensor({n})": e for n, e in (("float", TensorProto.FLOAT), ("float16", TensorProto.FLOAT16),
              ("double", TensorProto.DOUBLE), ("int8", TensorProto.INT8), ("uint8", TensorProto.UINT8),
              ("int16", TensorProto.INT16), ("int32", TensorProto.INT32), ("int64", TensorProto.INT64),
              ("bool", TensorProto.BOOL), ("bfloat16", TensorProto.BFLOAT16))}
_MAX_BYTES = 2_000_000_000  # one protobuf message
_KEYS = itertools.count()


def onnxruntime_available() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


class Segment:
    """One onnxruntime session over a run of standard nodes: torch tensors in, torch tensors out.
    aliases: output -> input whose buffer it is written into (a cache's ScatterND, decompose(in_place=True)):
    that output is bound to the input tensor's memory and returned as that very tensor."""

    def __init__(self, key: str, inputs: list[str], outputs: list[str], nodes: int, session,
                 aliases: dict[str, str] | None = None):
        self.key, self.inputs, self.outputs, self.nodes, self.session = key, inputs, outputs, nodes, session
        self.aliases = aliases or {}
        self._pos = {n: i for i, n in enumerate(inputs)}
        self._binding = None
        self._bound: dict[str, tuple] = {}  # name -> ((data_ptr, shape, dtype), the bound array: kept alive)

    def run(self, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.aliases:
            feeds = {n: t.detach().contiguous().numpy() for n, t in zip(self.inputs, ins)}
            return [torch.from_numpy(a) for a in self.session.run(self.outputs, feeds)]
        import onnxruntime as ort

        # one binding kept across runs: a tensor bound before (same memory, shape and dtype: the caches, every
        # step) is not bound again; the bound array is held, so that memory cannot be reused under the binding
        if self._binding is None:
            self._binding = self.session.io_binding()
        bind, bound = self._binding, self._bound
        for n, t in zip(self.inputs, ins):
            key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.is_contiguous() else None
            if key is None or bound.get(n, (None,))[0] != key:
                a = t.detach().contiguous().numpy()
                bind.bind_cpu_input(n, a)
                bound[n] = (key, a)
        for o in self.outputs:
            src = self.aliases.get(o)
            if src is None:  # bound anew every run: onnxruntime would otherwise reuse the last run's buffer
                bind.bind_output(o, "cpu")
                continue
            t = ins[self._pos[src]]
            if not t.is_contiguous():
                raise ValueError(f"input '{src}': a cache updated in place must be contiguous")
            key = ("out", t.data_ptr(), tuple(t.shape), t.dtype)
            if bound.get(o, (None,))[0] != key:
                a = t.detach().numpy()
                bind.bind_ortvalue_output(o, ort.OrtValue.ortvalue_from_numpy(a))
                bound[o] = (key, a)
        self.session.run_with_iobinding(bind)
        vals = bind._iobinding.get_outputs()  # the C values: no Python wrapper for each (aliased) cache
        return [ins[self._pos[self.aliases[o]]] if o in self.aliases else torch.from_numpy(v.numpy())
                for o, v in zip(self.outputs, vals)]


@dataclass
class DelegationReport:
    """What delegate() did: segments run by onnxruntime (name -> node count) and those kept (name -> why)."""

    delegated: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    barriers: int = 0
    decomposed: list[str] = field(default_factory=list)  # PagedAttention nodes run as standard ops in onnxruntime
    fused: bool = False  # their attention runs as ONNX Attention nodes (onnxruntime's kernel), where allowed


def _barrier(node: onnx.NodeProto) -> bool:
    """PagedAttention (onnxruntime has no CPU kernel; the ones decompose() rewrote are standard ops by now),
    the collectives AllReduce / AllGather (ops/collectives.py), nodes holding subgraphs, unknown domains, and MoE / QMoE with use_sparse_mixer=1. GroupQueryAttention is
    not one: onnxruntime's CPU kernel is the operator's reference implementation (contract-decisions §4); a
    segment it refuses stays with torch."""
    if (normalize_domain(node.domain), node.op_type) == ("com.microsoft", "PagedAttention"):
        return True
    if node.domain == "com.microsoft" and node.op_type in COLLECTIVE_OPS:
        return True  # torch.distributed runs them: onnxruntime's CPU build has no collective kernels
    if node.op_type in ("MoE", "QMoE") and any(a.name == "use_sparse_mixer" and a.i for a in node.attribute):
        return True  # onnxruntime's CPU MoE ignores use_sparse_mixer (1.32: softmax top-2); pagedkit's kernel has it
    if node.domain not in _KNOWN_DOMAINS and node.domain != "ai.onnx":
        return True
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def partition(graph: onnx.GraphProto) -> tuple[list[list[int]], list[list[int]]]:
    """(segments, barriers): node indices per level, in graph order (module docstring)."""
    level: dict[str, int] = {}
    segs: dict[int, list[int]] = {}
    bars: dict[int, list[int]] = {}
    for i, node in enumerate(graph.node):
        lv = max((level.get(x, 0) for x in node.input if x), default=0)
        if _barrier(node):
            bars.setdefault(lv, []).append(i)
            up = lv + 1
        else:
            segs.setdefault(lv, []).append(i)
            up = lv
        for o in node.output:
            if o:
                level[o] = up
    top = max(list(segs) + list(bars) + [0])
    return [segs.get(lv, []) for lv in range(top + 1)], [bars.get(lv, []) for lv in range(top + 1)]


def _value_info(name: str, facts: dict) -> onnx.ValueInfoProto | None:
    elem, shape = facts.get(name, (None, None))
    if elem not in _NUMPY_TYPES:
        return None
    if shape is None:
        return helper.make_tensor_value_info(name, elem, None)
    dims = [d if isinstance(d, (int, str)) and not isinstance(d, bool) else None for d in shape]
    return helper.make_tensor_value_info(name, elem, dims)


def _ort_session(model: onnx.ModelProto, threads: int, spin: bool = True, external_dir: str | None = None):
    """An onnxruntime CPU session with its own pool of `threads`. spin: let its workers spin between ops and
    runs (onnxruntime's default; only for a session holding the whole model: several sessions' spinning
    workers, or torch's threads between segments, fight for the cores). No global thread pool: it would
    oblige every other onnxruntime session of the process to opt in to it."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = max(1, threads)
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if external_dir is not None:  # the model's external data, read (memory-mapped) by onnxruntime from there
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", external_dir)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def delegate(model: onnx.ModelProto, base_dir: str | None, threads: int) -> tuple[onnx.ModelProto, list[Segment],
                                                                               DelegationReport]:
    """(the model with delegated segments replaced, the live segments, the report). `model` is not changed.
    PagedAttention nodes are first rewritten into standard ops with in-place cache writes (decompose(
    in_place=True)); if onnxruntime then refuses a segment holding such a rewrite (a dtype or op it lacks on
    the CPU), the whole delegation is redone without the rewrite (the nodes stay pagedkit's kernels)."""
    if not onnxruntime_available():
        return model, [], DelegationReport(kept={"*": "onnxruntime is not installed"})
    if any(n.op_type == "PagedAttention" and normalize_domain(n.domain) == "com.microsoft" for n in model.graph.node):
        from ..kernels.onnx_ops import decompose  # PagedAttention as standard ops, caches written in place

        first = None
        for fused in (True, False):  # attention as ONNX Attention nodes where allowed, else op by op
            try:
                rewritten, drep = decompose(model, in_place=True, fused=fused)
            except Exception as exc:  # a model onnx-ir cannot read: pagedkit's own loader reports it, clearly
                why = f"the attention rewrite failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                out, live, report = _delegate(model, base_dir, threads, [])
                report.kept.setdefault("(attention rewrite)", why)
                return out, live, report
            if not drep.changed:
                break
            out, live, report = _delegate(rewritten, base_dir, threads, list(drep.changed))
            if not report.kept:
                report.fused = fused and any(n.op_type == "Attention" and n.domain in ("", "ai.onnx")
                                             for n in rewritten.graph.node)
                return out, live, report
            _forget(live)
            first = first or next(iter(report.kept.items()))
        if first is not None:
            result = _delegate(model, base_dir, threads, [])
            result[2].kept.setdefault("(attention rewrite)", f"not used: {first[0]}: {first[1]}")
            return result
    return _delegate(model, base_dir, threads, [])


def _forget(live: list[Segment]) -> None:
    for seg in live:
        SEGMENTS.pop(seg.key, None)


def _delegate(model: onnx.ModelProto, base_dir: str | None, threads: int, decomposed: list[str]):
    g = model.graph
    facts, _ = static_facts(model)
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {vi.name for vi in g.input}
    segs, bars = partition(g)
    # spinning workers only when one session holds the whole model (SmolLM2 fp32, 2 cores, same run: 30.5 tok/s
    # with, 28.0 without; with several sessions or torch in between they fight for the cores)
    spin = sum(1 for seg in segs if seg) == 1 and not any(bars)
    readers: dict[str, set[int]] = {}
    for i, node in enumerate(g.node):
        for x in node.input:
            readers.setdefault(x, set()).add(i)
    graph_outputs = {o.name for o in g.output}
    report = DelegationReport(barriers=sum(map(len, bars)), decomposed=decomposed)
    live: list[Segment] = []
    new_nodes: list[onnx.NodeProto] = []
    moved: set[str] = set()  # initializers now inside a segment
    for lv, (seg, bar) in enumerate(zip(segs, bars)):
        name = f"segment_{lv}"
        if seg:
            node = _build(name, seg, g, facts, inits, graph_inputs, readers, graph_outputs, base_dir, threads,
                          model, report, live, moved, spin)
            new_nodes.extend([node] if node is not None else [g.node[i] for i in seg])
        new_nodes.extend(g.node[i] for i in bar)
    out = _shell(model)
    out.graph.node.extend(new_nodes)
    still = {x for n in new_nodes for x in n.input} | graph_outputs
    out.graph.initializer.extend(t for t in g.initializer if t.name in still or t.name not in moved)
    have = {vi.name for vi in out.graph.value_info}
    for n in new_nodes:  # typed boundaries: the session's shape inference cannot see into segments
        if n.domain == ORT_DOMAIN:
            for o in n.output:
                vi = _value_info(o, facts)
                if vi is not None and o not in have:
                    out.graph.value_info.append(vi)
    if live:
        out.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return out, live, report


def _shell(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model without nodes and initializers (everything else as it is)."""
    m = onnx.ModelProto()
    m.ir_version, m.producer_name, m.producer_version, m.domain = (model.ir_version, model.producer_name,
                                                                  model.producer_version, model.domain)
    m.model_version, m.doc_string = model.model_version, model.doc_string
    m.opset_import.extend(model.opset_import)
    m.metadata_props.extend(model.metadata_props)
    m.functions.extend(model.functions)
    src, dst = model.graph, m.graph
    dst.name, dst.doc_string = src.name, src.doc_string
    dst.input.extend(src.input)
    dst.output.extend(src.output)
    dst.value_info.extend(src.value_info)
    dst.sparse_initializer.extend(src.sparse_initializer)
    return m


def _build(name, seg, g, facts, inits, graph_inputs, readers, graph_outputs, base_dir, threads, model, report,
           live, moved, spin) -> onnx.NodeProto | None:
    """One segment's onnxruntime session and the node that stands for it; None (reason in the report) when
    it stays with pagedkit."""
    mine = set(seg)
    produced = [o for i in seg for o in g.node[i].output if o]
    made = set(produced)
    ins, used_inits, seen = [], [], set()
    for i in seg:
        for x in g.node[i].input:
            if not x or x in made or x in seen:
                continue
            seen.add(x)
            if x in inits and x not in graph_inputs:
                used_inits.append(x)
            else:
                ins.append(x)
    outs = [o for o in produced if o in graph_outputs or (readers.get(o, set()) - mine)]
    if not outs:
        report.kept[name] = "no outputs anyone reads"
        return None
    vis = {x: _value_info(x, facts) for x in ins}
    vis.update({x: _value_info(x, facts) or onnx.ValueInfoProto(name=x) for x in outs})  # onnxruntime infers
    untyped = [x for x in ins if vis[x] is None]
    if untyped:
        report.kept[name] = f"boundary value(s) of unknown or non-numpy type: {untyped[:3]}"
        return None
    sub = onnx.ModelProto(ir_version=model.ir_version)
    sub.opset_import.extend(model.opset_import)
    sub.functions.extend(model.functions)
    sg = sub.graph
    sg.name = name
    sg.node.extend(g.node[i] for i in seg)
    sg.input.extend(vis[x] for x in ins)
    sg.output.extend(vis[x] for x in outs)
    size, external = 0, False
    for x in used_inits:
        t = TensorProto()
        t.CopyFrom(inits[x])
        if uses_external_data(t):  # left where it is: onnxruntime maps it from the model's folder
            if base_dir is None:
                report.kept[name] = f"initializer '{x}' in external data without the model's folder"
                return None
            external = True  # load_model checked every location and range
        else:
            size += t.ByteSize()
        if size > _MAX_BYTES:
            report.kept[name] = "over 2 GB of inline weights in one segment"
            return None
        sg.initializer.append(t)
    try:
        session = _ort_session(sub, threads, spin, base_dir if external else None)
    except Exception as exc:  # onnxruntime refuses: an op, type or opset it lacks
        report.kept[name] = f"onnxruntime refused it: {str(exc).splitlines()[0][:200]}"
        return None
    del sub
    for arg in session.get_outputs():  # what onnxruntime inferred types the later segments' inputs
        elem = _ORT_TYPES.get(arg.type)
        if elem is not None and facts.get(arg.name, (None,))[0] is None:
            facts[arg.name] = (elem, tuple(arg.shape) if arg.shape is not None else None)
    key = f"{name}#{next(_KEYS)}"
    producer = {o: g.node[i] for i in seg for o in g.node[i].output if o}
    aliases = {o: producer[o].input[0] for o in outs
               if producer[o].op_type == "ScatterND" and producer[o].input[0] in ins}
    seg_obj = Segment(key, ins, outs, len(seg), session, aliases)
    SEGMENTS[key] = seg_obj  # the op's implementation (ops/control.py) finds it there
    live.append(seg_obj)
    moved.update(used_inits)
    report.delegated[name] = len(seg)
    return helper.make_node(SEGMENT_OP, ins, outs, name=name, domain=ORT_DOMAIN, key=key)
