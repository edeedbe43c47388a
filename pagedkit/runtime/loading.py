"""Safe model loading: never reads outside the model's folder, never executes anything from the model.

Every tensor that references external data (initializers, sparse initializers, attribute tensors,
in subgraphs too) is checked before any data is read, by the validators' check
(`pagedkit.validators.model_loading.external_data_problems`: relative location, no '..', resolving
inside the model's folder, symlinks included, file present), plus one check of our own before
reading: offset + length must lie within the file.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
from onnx.external_data_helper import ExternalDataInfo, uses_external_data

from ..validators.model_loading import (ModelLoadError, all_tensors, external_data_problems, load_model_proto,
                                        resolve_model_path)


class UnsafeModelError(ValueError):
    """The model references data outside its folder (or data that is not there)."""


def _has_external(model: onnx.ModelProto) -> bool:
    return any(uses_external_data(t) for _, t in all_tensors(model))


def _range_problems(model: onnx.ModelProto, base: Path) -> list[str]:
    problems = []
    for kind, t in all_tensors(model):
        if not uses_external_data(t):
            continue
        info = ExternalDataInfo(t)
        size = (base / info.location).stat().st_size
        offset = int(info.offset or 0)
        length = int(info.length) if info.length is not None else size - offset
        if offset < 0 or length < 0 or offset + length > size:
            problems.append(f"{kind} '{t.name}': external data range offset {offset} + length {length} lies "
                            f"beyond the end of {info.location!r} ({size} bytes)")
    return problems


def check_external_data(model: onnx.ModelProto, base_dir: str | os.PathLike) -> list[str]:
    """Every problem with the model's external-data references, as text (empty: safe to load)."""
    problems = [str(i) for i in external_data_problems(model, base_dir)]
    return problems or _range_problems(model, Path(base_dir).resolve())


def load_model(source) -> tuple[onnx.ModelProto, str | None]:
    """(model with external data loaded, base directory) from a path, a folder (its genai_config's
    decoder filename, else model.onnx), bytes or a ModelProto. Raises UnsafeModelError listing every
    unsafe external-data reference, before reading any external data."""
    if isinstance(source, onnx.ModelProto):
        if _has_external(source):
            raise UnsafeModelError("a ModelProto with unloaded external data: pass the model's path instead "
                                   "(its external data is then checked and loaded from its folder)")
        return source, None
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            model = onnx.load_model_from_string(bytes(source))
        except Exception as exc:  # protobuf's DecodeError (and friends): bad bytes, not a bug
            raise ModelLoadError(f"the bytes given are not an ONNX model ({type(exc).__name__})") from None
        if _has_external(model):
            raise UnsafeModelError("a model given as bytes cannot reference external data: pass its path")
        return model, None
    path, _, _ = resolve_model_path(source)  # ModelLoadError for a config path leading out of the folder
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    model = load_model_proto(path)  # ModelLoadError naming the file when it is not ONNX
    base = str(path.parent)
    problems = check_external_data(model, base)
    if problems:
        raise UnsafeModelError(f"{path}: unsafe external data: " + "; ".join(problems))
    onnx.load_external_data_for_model(model, base)
    return model, base
