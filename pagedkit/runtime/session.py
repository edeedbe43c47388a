"""`pagedkit.InferenceSession`: onnxruntime's Python API over a torch executor (CPU or CUDA).

Session creation does all the host-side work once (graph.py): safe loading, op lookup (every op we
cannot run is reported here, with op type, domain and node name), validation of every attention
node (the contract's static rules over the model's value_info: an invalid node fails creation with
every reason), the kernel variants serving each attention node (`attention_dispatch`), constant
folding of everything that depends only on initializers, placement
(shape-like values stay on the host, as onnxruntime keeps CPU-memory inputs there) and liveness (an
intermediate is dropped after its last use). `run_torch` then only launches work: persistent caches
are updated in place and returned as the present outputs, and nothing reads device memory back to
the host except inherently data-dependent ops (If conditions, NonZero) and the reference fallback.

Runs call the attention kernels without re-validating their inputs; `validate_inputs=True` (or the
environment variable PAGEDKIT_VALIDATE_INPUTS=1) re-checks the concrete inputs of every call
(validators.check_inputs), for debugging. A call that fails unvalidated is diagnosed by the same
checks, so a bad input is still a ValidationError naming the node and every issue.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import onnx
import torch
from onnx import TensorProto, helper

from .. import settings
from ..kernels.cpu.logits import ROWS_INPUT
from ..kernels.scope import run_scope
from ..kernels.variant import PLANS
from ..validators.issues import ValidationError
from . import plan as plan_mod
from . import prefetch
from .graph import CompiledModel, Graph, Step, compile_model
from .cpu_backend import CPU_BACKENDS, _auto_backend, _cpu_backend  # noqa: F401 (re-exported)
from .delegate import DelegationReport, KernelUnavailable, delegate
from .loading import load_model
from .tensors import TORCH_TO_ONNX, to_numpy, to_torch, torch_type_name, type_name

_PROVIDERS = ("CPUExecutionProvider", "CUDAExecutionProvider")


def _node_error(step: Step, exc: Exception) -> Exception:
    """The exception a failing op raises, naming the node."""
    if isinstance(exc, ValidationError):
        return ValidationError(exc.issues, f"node '{step.name}' ({step.op_type})")
    if isinstance(exc, ValueError):
        return ValueError(f"node '{step.name}' ({step.op_type}): {exc}")
    return RuntimeError(f"node '{step.name}' ({step.op_type}) failed: {exc}")


@dataclass
class NodeArg:
    """What get_inputs() / get_outputs() return, like onnxruntime's NodeArg: shape entries are ints
    (fixed), strings (symbolic) or None (unknown)."""

    name: str
    shape: list
    type: str


@dataclass
class ModelMetadata:
    """What get_modelmeta() returns, like onnxruntime's ModelMetadata."""

    producer_name: str = ""
    graph_name: str = ""
    domain: str = ""
    description: str = ""
    graph_description: str = ""
    version: int = 0
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


def _node_arg(vi: onnx.ValueInfoProto) -> tuple[NodeArg, int]:
    tt = vi.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim]
    return NodeArg(vi.name, shape, type_name(tt.elem_type)), tt.elem_type


@dataclass
class SessionOptions:
    """What InferenceSession(sess_options=...) reads, like onnxruntime.SessionOptions (an onnxruntime
    SessionOptions object is read the same way).

    intra_op_num_threads: threads of the CPU kernels (torch's intra-op pool; 0 = torch's default). torch's
    pool is per process: the last session created with a value sets it for every session.
    inter_op_num_threads: accepted for compatibility; the plan runs its steps in order on one thread.
    keep_segment_sources (pagedkit): delegated onnxruntime segments keep the model their session was made from
    (`Segment.source`; runtime/lite saves it as the CPU plan)."""

    intra_op_num_threads: int = 0
    inter_op_num_threads: int = 0
    keep_segment_sources: bool = False


def _apply_threads(options: Any) -> None:
    if options is None:
        return
    n = getattr(options, "intra_op_num_threads", 0)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"sess_options.intra_op_num_threads: expected an integer >= 0 (0 = default), got {n!r}")
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _select_device(providers) -> tuple[torch.device, list[str]]:
    names = [p[0] if isinstance(p, (tuple, list)) else p for p in (providers or ["CPUExecutionProvider"])]
    unknown = [p for p in names if p not in _PROVIDERS]
    if unknown:
        raise ValueError(f"providers: unknown {unknown}; expected CPUExecutionProvider or CUDAExecutionProvider")
    if "CUDAExecutionProvider" in names and torch.cuda.is_available():
        return torch.device("cuda"), ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if names and names[0] == "CUDAExecutionProvider" and "CPUExecutionProvider" not in names:
        raise RuntimeError("providers: CUDAExecutionProvider requested but CUDA is not available "
                           "(add CPUExecutionProvider to fall back to the CPU)")
    return torch.device("cpu"), ["CPUExecutionProvider"]


class InferenceSession:
    """Runs an ONNX model with PagedAttention / GroupQueryAttention nodes on torch.

    providers: ["CPUExecutionProvider"] (default) or ["CUDAExecutionProvider", ...].
    sess_options: a SessionOptions (or onnxruntime.SessionOptions): intra_op_num_threads sets the CPU threads.
    allow_reference_fallback: on CUDA, run attention combinations no GPU variant serves on the
    loop-based reference (one-time warning) instead of refusing at creation. Default (None): refused
    on CUDA (the error names the node, the feature and each variant's limit), allowed on the CPU.
    capturable: require CUDA-graph capturable attention kernels; a node whose serving variants are all
    non-capturable is refused at creation, naming the node and each variant (today no variant is
    capturable: torch_sdpa reads sequence lengths on the host, the reference runs on the host).
    validate_inputs: re-check every attention call's concrete inputs (default: the environment
    variable PAGEDKIT_VALIDATE_INPUTS=1; off otherwise, the nodes being validated at creation).
    cpu_backend: on the CPU, who runs the standard ops between attention nodes: "onnxruntime" (its CPU
    execution provider, one session per segment, runtime/delegate.py; segments it refuses stay with torch,
    see `delegated`; PagedAttention nodes it can express run there too, as standard ops with the caches
    written in place) or "torch" (pagedkit's own kernels for every op). Default: the environment variable
    PAGEDKIT_CPU_BACKEND, else "torch"; "auto" (the default of Generator and paged-run): "onnxruntime" unless
    the model holds float16 / bfloat16 weights (kept once, on torch). Ignored on CUDA.
    """

    def __init__(
        self,
        path_or_bytes: str | os.PathLike | bytes | onnx.ModelProto,
        sess_options: Any = None,
        providers: Sequence[str | tuple] | None = None,
        *,
        allow_reference_fallback: bool | None = None,
        capturable: bool = False,
        validate_inputs: bool | None = None,
        cpu_backend: str | None = None,
    ):
        _apply_threads(sess_options)
        owned = not isinstance(path_or_bytes, onnx.ModelProto)  # a proto of our own: its weights can go
        self._model, self._base_dir = load_model(path_or_bytes, lazy_weights=owned)
        self.device, self._providers = _select_device(providers)
        self.cpu_backend = _cpu_backend(cpu_backend) if self.device.type == "cpu" else "torch"
        if self.cpu_backend == "auto":
            self.cpu_backend = _auto_backend(self._model)
        self._segments: list = []  # live onnxruntime segments (delegate.py)
        self._delegation = None
        if self.cpu_backend == "onnxruntime":
            threads = getattr(sess_options, "intra_op_num_threads", 0) or os.cpu_count() or 1
            try:
                model, self._segments, self._delegation = delegate(
                    self._model, self._base_dir, threads,
                    keep=bool(getattr(sess_options, "keep_segment_sources", False)))
            except KernelUnavailable:
                raise
            except Exception as exc:  # a malformed model: the torch compiler below names what is wrong
                self._delegation = DelegationReport(kept={"*": f"not delegated: {type(exc).__name__}: {exc}"[:300]})
            else:
                owned = owned or model is not self._model  # delegate's model is a proto of our own
                self._model = model
                gc.collect()  # the rewrites' intermediate protos (reference cycles): freed now, not at the peak
            if self._segments and torch.get_num_threads() != 1:
                torch.set_num_threads(1)  # what runs on torch is small; the cores are onnxruntime's pool's
        if allow_reference_fallback is None:
            allow_reference_fallback = self.device.type == "cpu"
        self.allow_reference_fallback = bool(allow_reference_fallback)
        self.capturable = capturable
        self.validate_inputs = (settings.read("PAGEDKIT_VALIDATE_INPUTS") if validate_inputs is None
                                else bool(validate_inputs))
        self._plan: str | None = None  # the plan hint of the run in progress
        self._last_variants: dict[str, str] = {}
        graph = self._model.graph
        init_names = {i.name for i in graph.initializer}
        self._inputs, self._input_types, self._ranks = [], {}, {}
        self._feeds_ok: dict[str, tuple] = {}  # input name -> (dtype, shape, device type) that passed _check_feed
        self._feed_objs: dict[str, tuple] = {}  # input name -> (the tensor that passed last, its shape)
        for vi in graph.input:
            if vi.name not in init_names:
                arg, elem = _node_arg(vi)
                self._inputs.append(arg)
                self._input_types[vi.name] = elem
                self._ranks[vi.name] = len(arg.shape) if vi.type.tensor_type.HasField("shape") else None
        self._outputs = [_node_arg(vi)[0] for vi in graph.output]
        self._args = {a.name: a for a in self._inputs}
        self._input_names = set(self._args)
        self._overridable: set[str] = set()  # below, once the graph is compiled
        self._output_names = [a.name for a in self._outputs]
        self._compiled: CompiledModel = compile_model(self._model, self.device, allow_reference_fallback,
                                                      capturable=capturable, base_dir=self._base_dir,
                                                      release_initializers=owned)
        self._dev_copies: dict[int, torch.Tensor] = {}  # id(host const) -> its device copy (mixed ops)
        self._capture_keep: list | None = None  # set by a CUDA-graph capture (engine/graphs.py): pinned host copies
        self._programs: dict[int, plan_mod.Program] = {}  # id(subgraph) -> its plan
        self._envs: list = []  # values of the graphs being run (subgraphs read their enclosing scopes)
        self._main = self._bind(self._compiled.graph)
        self._prefetch = prefetch.attach(self._main, self.device)  # L2 prefetch in captured decode steps
        # overridable initializers a delegated segment reads (a graph input with a default value, e.g.
        # kernels/cpu/logits.py's row selection): run_torch may feed them; elsewhere folding fixed their value
        segment_ins = {n for op in self._main.ops if op.step.op_type == "Segment" for n in op.step.inputs}
        for vi in graph.input:
            if vi.name in init_names and vi.name in segment_ins and vi.name not in self._args:
                arg, elem = _node_arg(vi)
                self._args[vi.name] = arg
                self._input_types[vi.name] = elem
                self._ranks[vi.name] = len(arg.shape) if vi.type.tensor_type.HasField("shape") else None
                self._overridable.add(vi.name)
        if ROWS_INPUT in self._compiled.graph.inputs and ROWS_INPUT not in self._args:  # fuse.py's `logit_rows`
            arg, elem = _node_arg(helper.make_tensor_value_info(ROWS_INPUT, TensorProto.INT64, ["logit_rows"]))
            self._args[ROWS_INPUT], self._input_types[ROWS_INPUT], self._ranks[ROWS_INPUT] = arg, elem, 1
            self._overridable.add(ROWS_INPUT)

    # ---- what creation decided -------------------------------------------------------------------
    @property
    def attention_variants(self) -> dict[str, str]:
        """Attention node name -> the kernel variant a run without a plan hint uses (the first serving
        one, decided at creation; like ORT's SdpaKernel=)."""
        return dict(self._compiled.attention_variants)

    @property
    def attention_dispatch(self) -> dict[str, dict]:
        """Attention node name -> {"serving": [variant names, priority order], "refused": {variant: reason}},
        decided at creation from static information only."""
        return {name: call.report() for name, call in self._compiled.attention_calls.items()}

    @property
    def last_run_variants(self) -> dict[str, str]:
        """Attention node name -> the variant that ran it in the latest run (picked per run from the
        plan hint among the serving variants)."""
        return dict(self._last_variants)

    @property
    def prepacked(self) -> dict[str, str]:
        """Node name -> the layout its constant weight was given at creation (ops/packed.py), e.g.
        "oneDNN packed float32 (1.3 MiB)"; the stored tensor was replaced, not duplicated."""
        return dict(self._compiled.prepacked)

    @property
    def delegated(self) -> dict[str, Any]:
        """On the CPU with cpu_backend "onnxruntime": {"onnxruntime": {segment: node count}, "torch": {segment:
        why it stayed}, "attention_nodes": n, "lowered": [PagedAttention nodes run as one pagedkit.cpu node each
        (kernels/cpu)], "decomposed": [PagedAttention nodes run as standard ops], "onnx_attention": whether their
        attention is ONNX Attention nodes, "cpu_kernel": the CPU attention library or why not}; {} otherwise."""
        r = self._delegation
        if r is None:
            return {}
        return {"onnxruntime": dict(r.delegated), "torch": dict(r.kept), "attention_nodes": r.barriers,
                "lowered": list(r.lowered), "decomposed": list(r.decomposed), "onnx_attention": r.fused,
                "cpu_kernel": r.cpu_kernel, "widened": r.widened}

    def op_types(self) -> set[str]:
        """The op types of the nodes this session runs itself (a delegated onnxruntime segment counts as one op,
        "Segment")."""
        return {op.step.op_type for op in self._main.ops}

    def node_names(self, op_types) -> list[str]:
        """The names of the nodes of these op types that this session runs itself, in graph order."""
        return [op.step.name for op in self._main.ops if op.step.op_type in op_types]

    def single_segment(self):
        """(the onnxruntime Segment, its input names, its output names, {input: value} of those that are the model's
        constants, e.g. kernels/cpu/logits.py's row selection) when the whole model is one delegated segment (the
        onnxruntime CPU backend's usual result), else None. Its `run(list of tensors in input order)` is run_torch
        without the per-call feed checks, for callers whose feeds are correct by construction and whose first call
        went through run_torch (runtime/generate.py)."""
        from .ops.control import SEGMENTS
        from .ops.registry import ORT_DOMAIN

        prog = self._main
        if len(prog.ops) != 1 or prog.ops[0].step.op_type != "Segment" or prog.ops[0].step.domain != ORT_DOMAIN:
            return None
        step = prog.ops[0].step
        seg = SEGMENTS.get(step.attrs.get("key"))
        constants = {n: prog.template[prog.slot[n]] for n in step.inputs if n not in self._input_names}
        if seg is None or any(v is None for v in constants.values()):
            return None
        return seg, list(step.inputs), list(step.outputs), constants

    @property
    def fused(self) -> dict[str, int]:
        """Fusion rule (runtime/fuse.py) -> how many times creation applied it, e.g. {"swiglu_mlp": 30}."""
        return dict(self._compiled.fused)

    @property
    def host_inputs(self) -> frozenset[str]:
        """Graph inputs kept in host memory (read on the host: attention_metadata, shape operands)."""
        return self._compiled.host_inputs

    @property
    def cache_inputs(self) -> frozenset[str]:
        """Graph inputs that are attention caches: updated in place by run_torch."""
        return self._compiled.cache_inputs

    # ---- ORT-compatible API ---------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Graph inputs with a default value that run_torch / run may feed (onnxruntime's API): the ones a delegated
        onnxruntime segment reads, e.g. `pagedkit.logit_rows` (kernels/cpu/logits.py)."""
        return [self._args[n] for n in sorted(self._overridable)]

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return list(self._providers)

    def get_modelmeta(self) -> ModelMetadata:
        m = self._model
        return ModelMetadata(m.producer_name, m.graph.name, m.domain, m.doc_string, m.graph.doc_string,
                             m.model_version, {p.key: p.value for p in m.metadata_props})

    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options=None, *,
            plan: str | None = None) -> list:
        """numpy in, numpy out. Inputs are copied (caches included), so the caller's arrays are never
        mutated; the updated caches come back as the present outputs. Outputs never share memory with
        the session's constants or with each other. plan: see run_torch."""
        feeds = {}
        for name, value in input_feed.items():
            self._check_name(name)
            feeds[name] = to_torch(value, "cpu" if name in self.host_inputs else self.device, copy=True)
        names = self._requested(output_names)
        outs = self.run_torch(feeds, names, plan=plan)
        result, seen = [], set(self._compiled.const_storages)
        for n in names:
            t = outs[n]
            ptr = t.untyped_storage().data_ptr() if t.device.type == "cpu" and t.numel() else None
            arr = to_numpy(t)
            if ptr is not None and ptr in seen:
                arr = arr.copy()
            elif ptr is not None:
                seen.add(ptr)
            result.append(arr)
        return result

    def run_torch(self, feeds: Mapping[str, torch.Tensor], output_names: Sequence[str] | None = None, *,
                  plan: str | None = None, distinct_slots: bool = False) -> dict[str, torch.Tensor]:
        """Zero-copy run on torch tensors: cache inputs (`cache_inputs`) are updated in place and
        returned as their present outputs (the same tensors). A feed on the wrong device is moved (a
        copy), except a cache, which must already live where the session runs.
        plan: an optional host-side hint about this step ("decode", "prefill" = no cached prefix,
        "chunked_prefill"; None = anything) that picks, per attention node, the first serving variant
        serving that plan (`last_run_variants`). A wrong hint may pick a variant that cannot run the step.
        distinct_slots: the caller promises that no two tokens of this run write the same cache slot, except rows
        that write only a pad block nobody else reads (true of every KVCacheManager plan): the Triton cache write
        then skips its duplicate-slot handling (kernels/scope.py). A broken promise may leave a duplicated slot
        holding either token's bytes instead of the last token's."""
        names = self._requested(output_names)
        env_feeds = {}
        for name, t in feeds.items():
            self._check_name(name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"input '{name}': run_torch takes torch tensors, got {type(t).__name__} "
                                "(use run() for numpy)")
            env_feeds[name] = self._check_feed(name, t)
        missing = [a.name for a in self._inputs if a.name not in env_feeds]
        if missing:
            raise ValueError(f"missing input(s) {missing}")
        if plan is not None and plan not in PLANS:
            raise ValueError(f"plan {plan!r}: expected one of {list(PLANS)} or None")
        self._plan, self._last_variants = plan, {}
        with run_scope(distinct_slots=bool(distinct_slots)):  # attention nodes share the step's host bookkeeping
            vals = self._execute(self._main, env_feeds, None)
            if self._prefetch is not None:
                self._prefetch.join()
        slot = self._main.slot
        return {n: vals[slot[n]] for n in names}

    # ---- feeds ------------------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if name not in self._input_names and name not in self._overridable:
            raise ValueError(f"invalid input name '{name}'; the model's inputs are {sorted(self._input_names)}")

    def _requested(self, output_names) -> list[str]:
        names = list(output_names or self._output_names)
        unknown = [n for n in names if n not in self._output_names]
        if unknown:
            raise ValueError(f"invalid output name(s) {unknown}; the model's outputs are {self._output_names}")
        return names

    def _check_feed(self, name: str, t: torch.Tensor) -> torch.Tensor:
        last = self._feed_objs.get(name)
        if last is not None and last[0] is t and last[1] == t.shape:  # this very tensor passed last run (caches)
            return t
        seen = (t.dtype, t.shape, t.device.type)
        if self._feeds_ok.get(name) == seen:  # passed before with this dtype, shape and device
            self._feed_objs[name] = (t, t.shape)
            return t
        arg = self._args[name]
        want = self._input_types[name]
        if TORCH_TO_ONNX.get(t.dtype) != want:
            raise TypeError(f"input '{name}': unexpected data type {torch_type_name(t.dtype)}, "
                            f"expected {arg.type}")
        rank = self._ranks[name]
        if rank is not None and rank != t.dim():
            raise ValueError(f"input '{name}': invalid rank {t.dim()} (shape {list(t.shape)}), "
                             f"expected rank {len(arg.shape)} {arg.shape}")
        bad = [(i, d, t.shape[i]) for i, d in enumerate(arg.shape) if isinstance(d, int) and d != t.shape[i]]
        if bad:
            i, d, got = bad[0]
            raise ValueError(f"input '{name}': invalid dimension {i}: got {got}, expected {d} "
                             f"(shape {arg.shape}, got {list(t.shape)})")
        dev = torch.device("cpu") if name in self.host_inputs else self.device
        if t.device.type != dev.type:
            if name in self.cache_inputs:
                raise ValueError(f"input '{name}': a cache updated in place must be on {dev}, got {t.device}")
            t = t.to(dev)
        else:
            self._feeds_ok[name] = seen
            self._feed_objs[name] = (t, t.shape)
        return t

    # ---- execution ------------------------------------------------------------------------------
    def _bind(self, graph: Graph) -> plan_mod.Program:
        """The graph's execution plan with every op's call bound (subgraphs get plans of their own)."""
        prog = plan_mod.build(graph)
        for op in prog.ops:
            op.run = self._bind_op(op.step)
            for value in op.step.attrs.values():
                if isinstance(value, Graph):
                    self._programs[id(value)] = self._bind(value)
        return prog

    def _bind_op(self, step: Step):
        place = self.device.type != "cpu"
        if step.call is not None:
            call, name = step.call, step.name

            def run_attention(ins):
                outs = call.run(self._place(step, ins) if place else ins, plan=self._plan,
                                validate=self.validate_inputs)
                self._last_variants[name] = call.last_variant
                return outs

            return run_attention
        impl, attrs, ctx = step.impl, step.attrs, step.ctx
        if step.has_subgraph:
            sub_ctx = replace(ctx, run_subgraph=lambda g, f: self._run_subgraph(g, f, outer=self._envs[-1]))
            return lambda ins: list(impl(self._place(step, ins) if place else ins, attrs, sub_ctx))
        if place:
            return lambda ins: impl(self._place(step, ins), attrs, ctx)
        return lambda ins: impl(ins, attrs, ctx)

    def _execute(self, prog: plan_mod.Program, feeds: Mapping, outer: Mapping | None) -> list:
        vals = plan_mod.start(prog, feeds, outer)
        if not prog.has_subgraphs:
            return plan_mod.execute(prog, vals, _node_error)
        self._envs.append(prog.env(vals, outer))
        try:
            return plan_mod.execute(prog, vals, _node_error)
        finally:
            self._envs.pop()

    def _run_subgraph(self, graph: Graph, feeds, *, outer: Mapping) -> list[torch.Tensor]:
        if not isinstance(feeds, Mapping):
            feeds = dict(zip(graph.inputs, feeds))
        prog = self._programs[id(graph)]
        vals = self._execute(prog, feeds, outer)
        return [vals[j] for j in prog.outputs]

    def _place(self, step: Step, inputs: list) -> list:
        """Device ops get their data operands on the device (a host value computed at run time is
        copied, as onnxruntime inserts a memcpy; host constants use a copy made once); operands read
        on the host stay where they are."""
        dev = self.device
        host_in, elsewhere, on_dev = step.host_in, [], False  # one pass over the operands (every op, every run)
        for i, t in enumerate(inputs):
            if t is not None and i not in host_in:
                if t.device.type == dev.type:
                    on_dev = True
                else:
                    elsewhere.append(i)
        if not elsewhere or (not on_dev and step.call is None):
            return inputs  # all on the device already, or a host op (shape arithmetic): nothing moves
        out = list(inputs)
        for i in elsewhere:
            t = inputs[i]
            cached = self._dev_copies.get(id(t)) if id(t) in self._compiled.host_const_ids else None
            if cached is None and self._capture_keep is not None:  # inside a CUDA-graph capture: the
                # captured copy reads this host buffer at every replay, so it is pinned and kept alive (and a
                # constant's copy made here exists only in replays: not kept for eager runs)
                pinned = t.pin_memory()
                self._capture_keep.append(pinned)
                cached = pinned.to(dev, non_blocking=True)
            elif cached is None:  # a small host value (shape arithmetic): no wait for the copy
                cached = t.to(dev, non_blocking=True)
                if id(t) in self._compiled.host_const_ids:
                    self._dev_copies[id(t)] = cached
            out[i] = cached
        return out
