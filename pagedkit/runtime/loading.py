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

import numpy as np
import onnx
import torch
from onnx.external_data_helper import ExternalDataInfo, load_external_data_for_tensor, uses_external_data

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


_EAGER_INT = 1 << 16  # integer initializers up to this many elements are read at load (shape inference uses them)


def _eager(kind: str, t: onnx.TensorProto) -> bool:
    """Whether load_model(lazy_weights=True) reads this tensor's external data at load time."""
    if kind != "initializer":
        return True  # attribute / sparse tensors: small, read where they are
    small_int = t.data_type in (onnx.TensorProto.INT32, onnx.TensorProto.INT64)
    return small_int and int(np.prod(t.dims)) <= _EAGER_INT


def read_external(t: onnx.TensorProto, base_dir: str | os.PathLike) -> torch.Tensor:
    """An initializer's external data as a torch tensor, read straight from its file (one copy in memory;
    load_model checked the location and range). Raises ValueError when the length does not match the dims."""
    from .ops.util import INT4_TYPES, int4_from_bytes, torch_dtype

    info = ExternalDataInfo(t)
    path = Path(base_dir) / info.location
    offset = int(info.offset or 0)
    length = int(info.length) if info.length is not None else path.stat().st_size - offset
    if t.data_type in INT4_TYPES:  # two values per byte on disk, one per byte in the runtime (ops/util.py)
        want = -(-int(np.prod(t.dims)) // 2)
        if length != want:
            raise ValueError(f"initializer '{t.name}': external data holds {length} bytes, dims {list(t.dims)} of "
                             f"4-bit values need {want}")
        return int4_from_bytes(np.fromfile(path, dtype=np.uint8, count=length, offset=offset), t.data_type, t.dims)
    dtype = torch_dtype(t.data_type, f"initializer '{t.name}'")
    want = int(np.prod(t.dims)) * torch.empty((), dtype=dtype).element_size()
    if length != want:
        raise ValueError(f"initializer '{t.name}': external data holds {length} bytes, dims {list(t.dims)} of "
                         f"{dtype} need {want}")
    raw = np.fromfile(path, dtype=np.uint8, count=length, offset=offset)
    return torch.from_numpy(raw).view(dtype).reshape(tuple(t.dims))


def release_data(t: onnx.TensorProto) -> None:
    """Drop a tensor's data from the proto (after it was converted): keeps name, type and dims."""
    for name in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data",
                 "string_data", "external_data"):
        t.ClearField(name)
    t.data_location = onnx.TensorProto.DEFAULT


def load_model(source, *, lazy_weights: bool = False) -> tuple[onnx.ModelProto, str | None]:
    """(model with external data loaded, base directory) from a path, a folder (its genai_config's
    decoder filename, else model.onnx), bytes or a ModelProto. Raises UnsafeModelError listing every
    unsafe external-data reference, before reading any external data.
    lazy_weights: leave graph initializers in external data (except small integer ones) for the caller to
    read one at a time with read_external (the session does, so weights are never in memory twice)."""
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
    if not lazy_weights:
        onnx.load_external_data_for_model(model, base)
        return model, base
    for kind, t in all_tensors(model):
        if uses_external_data(t) and _eager(kind, t):
            load_external_data_for_tensor(t, base)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    return model, base
