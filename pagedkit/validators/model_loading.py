"""Loading a model for validation without reading its weights, and the external-data safety check.

The graph is read with `load_external_data=False`; `external_data_problems` reports every external-data
location (initializers, sparse initializers, attribute tensors; main graph, subgraphs and functions) that
is absolute, contains '..', resolves outside the model's folder (symlinks included) or does not exist.
Only after that check passes does model.py read the few small integer tensors the rules use.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import onnx
from onnx import TensorProto
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from ..interface.paths import UnsafePathError, check_config_paths, inside_folder
from .issues import Issue


def config_get(d: Any, *keys: str) -> Any:
    """d[k0][k1]... or None when a level is missing or not a mapping (genai_config lookups)."""
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


class ModelLoadError(ValueError):
    """The model file is missing, unreadable or not an ONNX model."""


def config_path(path: str | os.PathLike) -> Path:
    """The genai_config.json that goes with a model: in the folder `path`, or beside the .onnx file `path`."""
    path = Path(path)
    return (path if path.is_dir() else path.parent) / "genai_config.json"


def resolve_model_path(path: str | os.PathLike) -> tuple[Path, dict | None, list[Issue]]:
    """(model file, genai config or None, issues reading the config) for a .onnx file or a folder."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    config, issues = None, []
    cfg_path = config_path(path)
    if cfg_path.is_file():
        _inside(folder, "genai_config.json")
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
            if not isinstance(config, dict):
                raise ValueError("top level is not an object")
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
            config = None
            issues.append(Issue("model", f"file '{cfg_path.name}'", "MODEL-genai-config", "readable JSON object",
                                f"{type(exc).__name__}: {exc}"))
    if path.is_dir():
        # every file the config names must lie inside the folder (symlinks included), read or not
        try:
            check_config_paths(config, folder, str(cfg_path))
        except UnsafePathError as exc:
            raise ModelLoadError(str(exc)) from None
        name = config_get(config, "model", "decoder", "filename")
        path = _inside(folder, "model.onnx") if name is None else folder / name
    return path, config, issues


def _inside(folder: Path, name: str) -> Path:
    """folder / name (a fixed file name) when it resolves inside folder (symlinks included), else
    ModelLoadError."""
    try:
        return inside_folder(folder, name)
    except UnsafePathError as exc:
        raise ModelLoadError(str(exc)) from None


def load_model_proto(path: str | os.PathLike) -> onnx.ModelProto:
    """The model's graph without its external data; raises ModelLoadError when that is impossible."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise ModelLoadError(f"{path}: not an ONNX model ({type(exc).__name__})") from None
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise ModelLoadError(f"{path}: not an ONNX model (no ir_version or graph)")
    return model


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """graph and every subgraph (If / Loop / Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from graphs(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from graphs(g)


def all_tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """(kind, tensor) for every tensor that may hold data: initializers, sparse initializers and
    attribute tensors, in the main graph, subgraphs and functions."""
    bodies = list(graphs(model.graph)) + list(model.functions)
    for body in bodies:
        if isinstance(body, onnx.GraphProto):
            yield from (("initializer", t) for t in body.initializer)
            for s in body.sparse_initializer:
                yield from (("sparse initializer", t) for t in (s.values, s.indices))
        for node in body.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield f"attribute of node '{node.name or node.op_type}'", a.t
                yield from ((f"attribute of node '{node.name or node.op_type}'", t) for t in a.tensors)


def external_data_problems(model: onnx.ModelProto, base_dir: str | os.PathLike | None) -> list[Issue]:
    """Issues for external-data locations that are absolute, contain '..', resolve outside base_dir
    (symlinks included) or do not exist. Without base_dir only the spelling is checked."""
    issues = []
    base = Path(base_dir).resolve() if base_dir is not None else None
    for kind, t in all_tensors(model):
        if not uses_external_data(t):
            continue
        loc = ExternalDataInfo(t).location
        where = f"{kind} '{t.name}'"
        p = Path(loc)
        if not loc or p.is_absolute() or ".." in p.parts or re.match(r"^[A-Za-z]:|^[\\/]", loc):
            issues.append(Issue("model", where, "MODEL-external-data",
                                "a relative path inside the model's folder (no absolute path, no '..')",
                                f"location {loc!r}"))
        elif base is not None:
            target = (base / p).resolve()
            if base not in target.parents:
                issues.append(Issue("model", where, "MODEL-external-data", f"a file inside {base}",
                                    f"location {loc!r} resolving to {target}"))
            elif not target.is_file():
                issues.append(Issue("model", where, "MODEL-external-data", f"an existing file in {base}",
                                    f"missing file {loc!r}"))
    return issues
