"""Whole-model validation: every PagedAttention / GroupQueryAttention node plus the model-level rules.

`validate_model(model_or_path)` loads the graph (weights stay on disk: only small integer tensors are
read, after every external-data location was checked to be relative and inside the model's folder),
runs ONNX shape inference (non-strict, our schemas registered; a failure never fails validation),
collects element types / shapes (`value_info`) and integer constants, runs `validate_node` on every
com.microsoft attention node (subgraphs of If/Loop included) and then the rules in `RULE_DOCS`.

Cache convention (onnxruntime-genai's, contract-decisions §5/§8): in a model with several layers'
caches, layer i reads graph inputs `past_key_values.{i}.key` / `.value` (and, PER_TOKEN, `.key_scale` /
`.value_scale`) and writes graph outputs `present.{i}.key` / ... . Names come from `genai_config.json`
(`model.decoder.inputs.past_key_names`, `outputs.present_key_names`, `inputs.past_key_scale_names`, ...,
read by `pagedkit.interface.genai_config.cache_templates`, the reader every layer shares). A
single-layer model only needs each cache to be a graph input and each cache output a graph output
(ORT's test form).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator, Mapping

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from ..interface import names as N
from ..interface.genai_config import GENAI_CONFIG, cache_templates, read_genai_config
from .checks import validate_node
from .collectives import RULE_DOCS as COLLECTIVE_RULE_DOCS
from .collectives import collective_issues, register_collective_schemas
from .inference import type_of_proto, register_schemas
from .contract import BLOCK_SIZE_RULE, CONTRACTS, DOMAIN, block_size_error, get_contract
from .genai_schema import BLOCK_SIZE_FIELDS, ConfigProblem, GenaiConfigError, config_problems
from .issues import Issue
from .model_loading import (  # noqa: F401 (ModelLoadError is re-exported)
    ModelLoadError, config_path, external_data_problems, graphs, load_model_proto, resolve_model_path,
)
from .nodeview import Dim, dims_conflict, dtype_from_type_str, dtype_name

RULE_DOCS = {
    "MODEL-external-data": "External data locations must be relative paths inside the model's folder "
                           "(no absolute path, no '..', no symlink leading out) and the file must exist.",
    "MODEL-domain": "PagedAttention / GroupQueryAttention nodes must be in the 'com.microsoft' domain, "
                    "and the model must import that domain.",
    "MODEL-attention-metadata-graph-input": "attention_metadata must be a graph input fed from the host: "
                                            "never produced by a node, never an initializer (design §4.7).",
    "MODEL-cache-graph-input": "Each cache input (key_cache, value_cache, k/v_scale_cache; GQA past_key / "
                               "past_value) must be a graph input, not a node output or an initializer.",
    "MODEL-cache-written-back": "Each cache output must be a graph output, so the updated buffer is fed back "
                                "as the cache it came from.",
    "MODEL-cache-name": "With several layers' caches, cache inputs follow the genai names "
                        "(past_key_values.{i}.key / .value / .key_scale / .value_scale).",
    "MODEL-cache-output-name": "With several layers' caches, the cache output of layer i is the matching "
                               "present name (present.{i}.key for past_key_values.{i}.key, ...).",
    "MODEL-cache-layer": "All caches of one node belong to the same layer index.",
    "MODEL-cache-pair-type": "A cache graph input and its graph output have the same element type and shape "
                             "(GroupQueryAttention: same batch, kv heads and head size; the length may grow).",
    "MODEL-extension-input": "slot_mapping / query_positions given as graph inputs are int32 [num_tokens].",
    "MODEL-genai-config": "genai_config.json beside the model must be readable JSON.",
    "MODEL-block-size": f"The block size genai_config.json names (pagedkit.block_size, "
                        f"engine.dynamic_batching.block_size): {BLOCK_SIZE_RULE}.",
    **COLLECTIVE_RULE_DOCS,  # AllReduce / AllGather of a tensor-parallel rank's graph (collectives.py)
}

PAGED_ONLY_RULES = ("MODEL-attention-metadata-graph-input", "MODEL-extension-input", "MODEL-block-size")

# (cache input, its updated output, genai name kind) of each cache pair, by contract name
_CACHE_PAIRS = {op: c.cache_pairs for op, c in CONTRACTS.items()}  # (input, output, kind)
_GQA_PAIR_DIMS = (0, 1, 3)  # batch, kv heads, head size (dimension 2 is past vs present length)
_MAX_CONST_ELEMS = 1 << 16

TensorType = tuple[int | None, tuple[Dim, ...] | None]


@dataclass
class ModelReport:
    issues: list[Issue]
    attention_nodes: int
    path: str | None = None


# ----------------------------------------------------------------------------------------------
# What is known: types/shapes after shape inference, integer constants, producers
# ----------------------------------------------------------------------------------------------

def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    register_schemas()  # our nodes' outputs get types and shapes
    register_collective_schemas()  # and the collectives' of tensor-parallel graphs
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)
    except Exception:  # shape inference is a help, never a reason to fail validation
        return model


def _type_of(tp: onnx.TypeProto) -> TensorType:
    return type_of_proto(tp)  # the one TypeProto -> (elem, shape) conversion (inference.py)


def _collect(model: onnx.ModelProto, base_dir: str | None, safe: bool):
    value_info: dict[str, TensorType] = {}
    constants: dict[str, np.ndarray] = {}
    producers: dict[str, onnx.NodeProto] = {}
    initializers: set[str] = set()
    for g in graphs(model.graph):
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.HasField("tensor_type"):
                value_info.setdefault(vi.name, _type_of(vi.type))
        for t in g.initializer:
            initializers.add(t.name)
            value_info[t.name] = (t.data_type or None, tuple(int(d) for d in t.dims))
            if t.data_type in (TensorProto.INT32, TensorProto.INT64) and np.prod(t.dims) <= _MAX_CONST_ELEMS:
                constants[t.name] = _int_array(t, base_dir, safe)
        for node in g.node:
            for o in node.output:
                if o:
                    producers[o] = node
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and node.output:
                val = _constant_value(node)
                if val is not None:
                    constants[node.output[0]] = val
    return value_info, {k: v for k, v in constants.items() if v is not None}, producers, initializers


def _int_array(t: TensorProto, base_dir: str | None, safe: bool) -> np.ndarray | None:
    try:
        if uses_external_data(t):
            if base_dir is None or not safe:
                return None
            t = TensorProto.FromString(t.SerializeToString())
            load_external_data_for_tensor(t, base_dir)
        return numpy_helper.to_array(t)
    except Exception:
        return None


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value" and a.t.data_type in (TensorProto.INT32, TensorProto.INT64) \
                and not uses_external_data(a.t):
            return numpy_helper.to_array(a.t)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None


# ----------------------------------------------------------------------------------------------
# Whole-model rules
# ----------------------------------------------------------------------------------------------

def cache_names(genai_config: Mapping | None) -> dict[str, tuple[str, str]]:
    """{kind: (past pattern, present pattern)} with '%d' for the layer, from genai_config or defaults."""
    return cache_templates(genai_config)


def _layer_of(name: str, pattern: str) -> int | None:
    try:
        return N.layer_of(name, pattern)
    except ValueError:  # a configured name that is not a one-'%d' template matches no cache
        return None


def _spell(pattern: str) -> str:
    """A '%d' template as the rule texts spell it: past_key_values.{i}.key."""
    return pattern.replace(N.LAYER, "{i}")


def _format(pattern: str, layer: int) -> str | None:
    try:
        return N.layer_name(pattern, layer)
    except ValueError:
        return None


def _where(kind: str, contract, index: int) -> str:
    params = contract.inputs if kind == "input" else contract.outputs
    return f"{kind} '{params[index].name}'"


class _Model:
    """The loaded graph and what is known about it, for the whole-model rules."""

    def __init__(self, model: onnx.ModelProto, value_info, producers, initializers, names, several: bool):
        g = model.graph
        self.inputs = {vi.name for vi in g.input} - initializers
        self.outputs = {vi.name for vi in g.output}
        self.declared = {vi.name: _type_of(vi.type) for vi in list(g.input) + list(g.output)
                         if vi.type.HasField("tensor_type")}
        self.value_info, self.producers, self.initializers = value_info, producers, initializers
        self.names, self.several = names, several

    def source(self, name: str) -> str | None:
        """None when name is a graph input, else what it is instead."""
        if name in self.initializers:
            return f"initializer '{name}'"
        if name in self.producers:
            p = self.producers[name]
            return f"'{name}', the output of node '{p.name or p.op_type}' ({p.op_type})"
        if name not in self.inputs:
            return f"'{name}', which is not a graph input"
        return None


def _key_cache(node: onnx.NodeProto) -> str:
    """The tensor feeding the node's key cache input ('' when absent or not one of our ops' domain)."""
    if node.domain != DOMAIN:
        return ""
    idx = get_contract(node.op_type).input_index(_CACHE_PAIRS[node.op_type][0][0])
    return node.input[idx] if len(node.input) > idx else ""


def _metadata_rule(node: onnx.NodeProto, m: _Model) -> Iterator[Issue]:
    c = get_contract(node.op_type)
    if c.name != "PagedAttention":
        return
    idx = c.input_index("attention_metadata")
    name = node.input[idx] if len(node.input) > idx else ""
    if name and (src := m.source(name)):
        yield Issue(node.name or node.op_type, _where("input", c, idx), "MODEL-attention-metadata-graph-input",
                    "a graph input fed from the host", src)


def _cache_rules(node: onnx.NodeProto, m: _Model) -> Iterator[Issue]:
    c = get_contract(node.op_type)
    nn = node.name or node.op_type
    layers: dict[int, str] = {}
    for in_name, out_name, kind in _CACHE_PAIRS[c.name]:
        i_in, i_out = c.input_index(in_name), c.output_index(out_name)
        cache = node.input[i_in] if len(node.input) > i_in else ""
        out = node.output[i_out] if len(node.output) > i_out else ""
        if not cache:
            continue
        w_in, w_out = _where("input", c, i_in), _where("output", c, i_out)
        past_pat, present_pat = m.names[kind]
        src = m.source(cache)
        if src:
            yield Issue(nn, w_in, "MODEL-cache-graph-input", "a graph input" + (
                f" named {_spell(past_pat)!r}" if m.several else ""), src)
        layer = _layer_of(cache, past_pat) if m.several else None
        if m.several and not src and layer is None:
            yield Issue(nn, w_in, "MODEL-cache-name", f"a graph input named {_spell(past_pat)!r}", repr(cache))
        if layer is not None:
            layers[layer] = cache
        if not out:
            continue
        expected_out = _format(present_pat, layer) if layer is not None else None
        if out not in m.outputs:
            yield Issue(nn, w_out, "MODEL-cache-written-back",
                        f"graph output {expected_out!r}" if expected_out else "a graph output",
                        f"{out!r}, which is not a graph output",
                        f"the update of cache '{cache}' must be written back")
        elif expected_out and out != expected_out:
            yield Issue(nn, w_out, "MODEL-cache-output-name", repr(expected_out), repr(out),
                        f"cache '{cache}' (layer {layer}) is written back as '{out}'")
        if not src and out in m.outputs:
            yield from _pair_type_rule(nn, c.name, w_out, cache, out, m)
    if len(layers) > 1:
        yield Issue(nn, "node", "MODEL-cache-layer", "caches of one layer index",
                    ", ".join(f"{n!r} (layer {i})" for i, n in sorted(layers.items())))


def _pair_type_rule(nn: str, op: str, where: str, cache: str, out: str, m: _Model) -> Iterator[Issue]:
    (t_in, s_in), (t_out, s_out) = m.declared.get(cache, (None, None)), m.declared.get(out, (None, None))
    if t_in and t_out and t_in != t_out:
        yield Issue(nn, where, "MODEL-cache-pair-type", f"element type {dtype_name(t_in)} (as graph input '{cache}')",
                    f"{dtype_name(t_out)} for graph output '{out}'")
    if s_in is None or s_out is None:
        return
    dims = range(len(s_in)) if op == "PagedAttention" else _GQA_PAIR_DIMS
    if len(s_in) != len(s_out):
        yield Issue(nn, where, "MODEL-cache-pair-type", f"rank {len(s_in)} (as graph input '{cache}')",
                    f"rank {len(s_out)} for graph output '{out}'")
    elif any(d < len(s_in) and dims_conflict(s_in[d], s_out[d]) for d in dims):
        yield Issue(nn, where, "MODEL-cache-pair-type", f"shape {_shape(s_in)} (as graph input '{cache}')",
                    f"{_shape(s_out)} for graph output '{out}'")


def _shape(s) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in s) + ")"


def _extension_input_rules(node: onnx.NodeProto, m: _Model) -> Iterator[Issue]:
    c = get_contract(node.op_type)
    if c.name != "PagedAttention":
        return
    for pname in ("slot_mapping", "query_positions"):
        idx = c.input_index(pname)
        name = node.input[idx] if len(node.input) > idx else ""
        if not name or name not in m.inputs:
            continue
        elem, shape = m.declared.get(name, (None, None))
        q_idx = c.input_index("query")
        q = node.input[q_idx] if len(node.input) > q_idx else ""
        q_shape = m.value_info.get(q, (None, None))[1]
        allowed = {dtype_from_type_str(t) for t in c.allowed_types(c.input(pname))}  # S: int32
        got = []
        if elem is not None and elem not in allowed:
            got.append(f"element type {dtype_name(elem)}")
        if shape is not None and len(shape) != 1:
            got.append(f"rank {len(shape)}")
        elif shape is not None and q_shape and dims_conflict(shape[0], q_shape[0]):
            got.append(f"{shape[0]} entries for {q_shape[0]} tokens")
        if got:
            yield Issue(node.name or node.op_type, _where("input", c, idx), "MODEL-extension-input",
                        "int32 [num_tokens]", f"graph input '{name}' with " + ", ".join(got))


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------

def _block_size_rule(problems: list[ConfigProblem]) -> Iterator[Issue]:
    """MODEL-block-size: the block sizes a genai_config.json names (the schema's block-size rows) follow the
    contract's rule."""
    for p in problems:
        yield Issue(GENAI_CONFIG, p.field, "MODEL-block-size", p.expected, p.got, block_size_error(p.value))


def _check_config(genai_config: Mapping | None, where: str) -> list[ConfigProblem]:
    """The block-size problems of genai_config (MODEL-block-size issues of a paged model); every other
    schema problem (genai_schema.py) is bad input, raised at once as one GenaiConfigError (a ValueError
    naming each field and its expected value) whose text names `where`."""
    problems = [] if genai_config is None else config_problems(genai_config)
    bad = [p for p in problems if p.row.path not in BLOCK_SIZE_FIELDS]
    if bad:
        raise GenaiConfigError(bad, where)
    return problems


def check_model(model: onnx.ModelProto | str | os.PathLike, *, genai_config=None) -> ModelReport:
    """validate_model with a count of the attention nodes checked (for the CLI)."""
    issues: list[Issue] = []
    path = base_dir = None
    where = str(genai_config) if isinstance(genai_config, (str, os.PathLike)) else GENAI_CONFIG
    if isinstance(genai_config, (str, os.PathLike)):
        genai_config = read_genai_config(genai_config)
    if not isinstance(model, onnx.ModelProto):
        path, found_config, cfg_issues = resolve_model_path(model)
        if genai_config is None:
            genai_config, issues = found_config, cfg_issues
            where = str(config_path(model))
    block_problems = _check_config(genai_config, where)  # GenaiConfigError before the model is read
    if isinstance(model, onnx.ModelProto):
        proto = model
    else:
        proto = load_model_proto(path)
        base_dir = str(path.parent)
    ext_issues = external_data_problems(proto, base_dir)
    issues += ext_issues
    inferred = _infer(proto)
    value_info, constants, producers, initializers = _collect(inferred, base_dir, safe=not ext_issues)

    attention = []  # (node, in main graph)
    for g in graphs(inferred.graph):
        for node in g.node:
            if node.op_type in CONTRACTS:
                attention.append((node, g is inferred.graph))
    imports = {o.domain for o in proto.opset_import}
    names = cache_names(genai_config)
    several = genai_config is not None or sum(1 for n, main in attention if main and _key_cache(n)) > 1
    m = _Model(inferred, value_info, producers, initializers, names, several)
    checked = 0
    for node, main in attention:
        nn = node.name or node.op_type
        if node.domain != DOMAIN:
            issues.append(Issue(nn, "node", "MODEL-domain", f"domain {DOMAIN!r}", repr(node.domain)))
            continue
        checked += 1
        node_issues = validate_node(node, value_info, constants)
        seen = {(i.node, i.where) for i in node_issues}
        issues += node_issues
        issues += _metadata_rule(node, m)
        if main:
            issues += _cache_rules(node, m)
            issues += [i for i in _extension_input_rules(node, m) if (i.node, i.where) not in seen]
    issues += collective_issues([n for g in graphs(inferred.graph) for n in g.node], value_info, genai_config)
    if any(n.op_type == "PagedAttention" for n, _ in attention):
        issues += _block_size_rule(block_problems)
    if checked and DOMAIN not in imports:
        issues.append(Issue("model", "model", "MODEL-domain", f"an opset_import of {DOMAIN!r}",
                            "no such import"))
    return ModelReport(issues, checked, None if path is None else str(path))


def validate_model(model: onnx.ModelProto | str | os.PathLike, *, genai_config=None) -> list[Issue]:
    """Issues of a whole model: every com.microsoft PagedAttention / GroupQueryAttention node (validate_node,
    with shapes from ONNX shape inference) plus the whole-model rules of RULE_DOCS.

    model: a ModelProto, a .onnx path or a folder holding model.onnx (and genai_config.json).
    genai_config: dict or path of genai_config.json; by default the one beside the model, if any.
    Raises ModelLoadError when the file is missing or not ONNX, GenaiConfigError (genai_schema.py) when
    genai_config breaks the schema (all its problems on one line; block sizes are MODEL-block-size issues);
    everything else is an Issue.
    """
    return check_model(model, genai_config=genai_config).issues
