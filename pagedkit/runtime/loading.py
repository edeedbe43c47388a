"""Safe model loading: never reads outside the model's folder, never executes anything from the model."""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data


class UnsafeModelError(ValueError):
    pass


def _external_tensors(model: onnx.ModelProto):
    yield from (t for t in model.graph.initializer if uses_external_data(t))
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and uses_external_data(a.t):
                yield a.t


def check_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike) -> list[str]:
    """Problems with external-data locations: absolute paths, '..', or anything resolving outside
    base_dir (symlinks included)."""
    problems = []
    base = Path(base_dir).resolve()
    for t in _external_tensors(model):
        loc = ExternalDataInfo(t).location
        p = Path(loc)
        if p.is_absolute() or ".." in p.parts or not loc:
            problems.append(f"initializer '{t.name}': external data location {loc!r} must be a relative path "
                            f"inside the model's folder")
            continue
        target = (base / p).resolve()
        if base not in target.parents and target != base:
            problems.append(f"initializer '{t.name}': external data location {loc!r} resolves outside {base}")
        elif not target.is_file():
            problems.append(f"initializer '{t.name}': external data file {loc!r} not found in {base}")
    return problems


def load_model(source) -> tuple[onnx.ModelProto, str | None]:
    """(model with external data loaded, base directory) from a path, a folder holding model.onnx,
    bytes or a ModelProto."""
    if isinstance(source, onnx.ModelProto):
        return source, None
    if isinstance(source, (bytes, bytearray)):
        model = onnx.load_model_from_string(bytes(source))
        if any(True for _ in _external_tensors(model)):
            raise UnsafeModelError("a model given as bytes cannot reference external data")
        return model, None
    path = Path(source)
    if path.is_dir():
        path = path / "model.onnx"
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    model = onnx.load(str(path), load_external_data=False)
    base = str(path.parent)
    problems = check_external_data(model, base)
    if problems:
        raise UnsafeModelError("; ".join(problems))
    onnx.load_external_data_for_model(model, base)
    return model, base
