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
from onnx import TensorProto, helper
from onnx.external_data_helper import uses_external_data

from .graph import static_facts
from .ops.collectives import COLLECTIVE_OPS
from .ops.control import SEGMENTS
from .ops.registry import ORT_DOMAIN, normalize_domain
from .segment import Segment

SEGMENT_OP = "Segment"
_KNOWN_DOMAINS = {"", "com.microsoft", "pagedkit.cpu"}  # pagedkit.cpu: kernels/cpu
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


@dataclass
class DelegationReport:
    """What delegate() did: segments run by onnxruntime (name -> node count) and those kept (name -> why)."""

    delegated: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    barriers: int = 0
    decomposed: list[str] = field(default_factory=list)  # PagedAttention nodes run as standard ops in onnxruntime
    fused: bool = False  # their attention runs as ONNX Attention nodes (onnxruntime's kernel), where allowed
    lowered: list[str] = field(default_factory=list)  # PagedAttention nodes run as one pagedkit.cpu node each
    cpu_kernel: str = ""  # the CPU attention library's path, or why it is not used
    widened: int = 0  # float16 weights widened to float32 (kernels/cpu/widen.py)


@dataclass(frozen=True)
class SegmentSource:
    """What a segment's onnxruntime session was made from (delegate(keep=True)): its model, the folder of the
    external data it maps (None: all inline), the CPU attention library it registers (None: none) and whether
    its workers spin."""

    model: onnx.ModelProto
    external_dir: str | None
    library: str | None
    spin: bool


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


def _ort_session(model: onnx.ModelProto, threads: int, spin: bool = True, external_dir: str | None = None,
                 library: str | None = None):
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
    if library is not None:  # the pagedkit.cpu attention op (kernels/cpu)
        so.register_custom_ops_library(library)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def delegate(model: onnx.ModelProto, base_dir: str | None, threads: int, *, keep: bool = False
             ) -> tuple[onnx.ModelProto, list[Segment], DelegationReport]:
    """(the model with delegated segments replaced, the live segments, the report). `model` is not changed.
    keep: each Segment keeps the model onnxruntime was given (`Segment.source`: runtime/lite saves it).
    PagedAttention nodes the CPU attention library serves become one pagedkit.cpu node each (kernels/cpu: lower),
    the others are rewritten into standard ops with in-place cache writes (decompose(in_place=True)); if
    onnxruntime then refuses a segment holding such a node (a dtype or op it lacks on the CPU), the delegation
    is redone without the library, then without the rewrite (the nodes stay pagedkit's kernels)."""
    if not onnxruntime_available():
        return model, [], DelegationReport(kept={"*": "onnxruntime is not installed"})
    if not any(n.op_type == "PagedAttention" and normalize_domain(n.domain) == "com.microsoft"
               for n in model.graph.node):
        return _delegate(model, base_dir, threads, [], keep=keep)
    from ..kernels.cpu.logits import select_logit_rows
    from ..kernels.cpu.lower import LowerReport, lower
    from ..kernels.cpu.widen import why_not as widen_refusal, widen

    widened = 0
    if widen_refusal(model) is None:  # float16 weights: float32 outside attention (onnxruntime has no fp16 MatMul)
        model, wrep = widen(model)
        widened = wrep.widened_weights
    else:
        model = _copy(model)
    select_logit_rows(model)  # the LM head for the rows a caller asks for (Generator: the last), else all
    library, why_not = cpu_attention_library()
    first = None
    for lowering in ((True, False) if library else (False,)):
        base, lrep = lower(model, threads) if lowering else (model, LowerReport())
        if lowering and not lrep.lowered:
            continue
        for fused in (True, False):  # attention as ONNX Attention nodes where allowed, else op by op
            try:
                rewritten, drep = _decompose(base, fused)
            except Exception as exc:  # a model onnx-ir cannot read: pagedkit's own loader reports it, clearly
                why = f"the attention rewrite failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                out, live, report = _delegate(model, base_dir, threads, [], keep=keep)
                report.kept.setdefault("(attention rewrite)", why)
                return out, live, report
            if not drep.changed and not lrep.lowered:
                break
            out, live, report = _delegate(rewritten, base_dir, threads, list(drep.changed),
                                          library if lowering else None, lrep.in_place, keep=keep)
            if not report.kept:
                report.fused = fused and any(n.op_type == "Attention" and n.domain in ("", "ai.onnx")
                                             for n in rewritten.graph.node)
                report.lowered = list(lrep.lowered)
                report.widened = widened
                report.cpu_kernel = library if lowering else why_not or "not used: onnxruntime refused its nodes"
                return out, live, report
            _forget(live)
            first = first or next(iter(report.kept.items()))
            if not drep.changed:
                break
    if first is not None:
        out, live, report = _delegate(model, base_dir, threads, [], keep=keep)
        report.kept.setdefault("(attention rewrite)", f"not used: {first[0]}: {first[1]}")
        return out, live, report
    return _delegate(model, base_dir, threads, [], keep=keep)


@dataclass(frozen=True)
class _Nothing:
    changed: tuple = ()


_NOTHING_DECOMPOSED = _Nothing()


def _decompose(model: onnx.ModelProto, fused: bool):
    """decompose(in_place=True) of the PagedAttention nodes left (none left: the model as it is, and onnx-ir
    is not even imported)."""
    if not any(n.op_type == "PagedAttention" and normalize_domain(n.domain) == "com.microsoft"
               for n in model.graph.node):
        return model, _NOTHING_DECOMPOSED
    from ..kernels.onnx_ops import decompose  # PagedAttention as standard ops, caches written in place

    return decompose(model, in_place=True, fused=fused)


def cpu_attention_library() -> tuple[str | None, str]:
    """(the CPU attention library, "") or (None, why not): PAGEDKIT_CPU_ATTENTION=decompose turns it off, `kernel`
    makes its absence an error."""
    from .. import settings
    from ..kernels.cpu.build import library

    path, why = library()
    if path is None and settings.read("PAGEDKIT_CPU_ATTENTION") == "kernel":
        raise KernelUnavailable(f"PAGEDKIT_CPU_ATTENTION=kernel: the CPU attention library is not available: {why}")
    return path, why


class KernelUnavailable(RuntimeError):
    """PAGEDKIT_CPU_ATTENTION=kernel and the CPU attention library cannot be built (the session raises it)."""


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)  # weights in external data (the session's lazy load) are references, not bytes
    return out


def _forget(live: list[Segment]) -> None:
    for seg in live:
        SEGMENTS.pop(seg.key, None)


def _delegate(model: onnx.ModelProto, base_dir: str | None, threads: int, decomposed: list[str],
              library: str | None = None, in_place: dict[str, str] | None = None, keep: bool = False):
    g = model.graph
    facts, _ = static_facts(model)
    inits = {t.name: t for t in g.initializer}
    graph_inputs = {vi.name for vi in g.input}
    for vi in g.input:  # an overridable initializer (a graph input with a default) takes any shape it declares
        if vi.name in inits and vi.type.tensor_type.HasField("shape"):
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                         for d in vi.type.tensor_type.shape.dim)
            facts[vi.name] = (vi.type.tensor_type.elem_type, dims)
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
                          model, report, live, moved, spin, (library, in_place or {}), keep)
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
           live, moved, spin, lowered, keep: bool = False) -> onnx.NodeProto | None:
    """One segment's onnxruntime session and the node that stands for it; None (reason in the report) when
    it stays with pagedkit. lowered: (the CPU attention library, cache output -> cache input of its nodes).
    keep: the Segment keeps `sub` and how its session was made (Segment.source)."""
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
    library, in_place = lowered
    cpu_nodes = [i for i in seg if g.node[i].domain == "pagedkit.cpu"]
    # the caches a pagedkit.cpu node writes in its input buffers: outputs of the Segment, not of onnxruntime
    written = {o: in_place[o] for i in cpu_nodes for o in g.node[i].output[1:] if o in in_place and o in outs}
    for i in seg:
        node = g.node[i]
        if i in cpu_nodes:  # onnxruntime sees its one output (the attention's)
            node = helper.make_node(node.op_type, node.input, node.output[:1], name=node.name, domain=node.domain)
            node.attribute.extend(g.node[i].attribute)
        sg.node.append(node)
    sg.input.extend(vis[x] for x in ins)
    sg.output.extend(vis[x] for x in outs if x not in written)
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
        session = _ort_session(sub, threads, spin, base_dir if external else None, library if cpu_nodes else None)
    except Exception as exc:  # onnxruntime refuses: an op, type or opset it lacks
        report.kept[name] = f"onnxruntime refused it: {str(exc).splitlines()[0][:200]}"
        return None
    source = SegmentSource(sub, base_dir if external else None, library if cpu_nodes else None, spin) if keep else None
    del sub
    for arg in session.get_outputs():  # what onnxruntime inferred types the later segments' inputs
        elem = _ORT_TYPES.get(arg.type)
        if elem is not None and facts.get(arg.name, (None,))[0] is None:
            facts[arg.name] = (elem, tuple(arg.shape) if arg.shape is not None else None)
    key = f"{name}#{next(_KEYS)}"
    producer = {o: g.node[i] for i in seg for o in g.node[i].output if o}
    aliases = {o: producer[o].input[0] for o in outs
               if producer[o].op_type == "ScatterND" and producer[o].input[0] in ins}
    seg_obj = Segment(key, ins, outs, len(seg), session, aliases, written)
    seg_obj.source = source
    SEGMENTS[key] = seg_obj  # the op's implementation (ops/control.py) finds it there
    live.append(seg_obj)
    moved.update(used_inits)
    report.delegated[name] = len(seg)
    return helper.make_node(SEGMENT_OP, ins, outs, name=name, domain=ORT_DOMAIN, key=key)
