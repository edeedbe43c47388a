"""Element types, one table: ONNX element type (TensorProto int) <-> onnxruntime's type string
("tensor(float16)") <-> torch dtype <-> numpy dtype.

torch is imported only inside the functions that return torch dtypes / tensors, so the validators (which
use the ONNX <-> string half) stay free of torch. numpy has no bfloat16 / float8 of its own: those are
ml_dtypes arrays, moved to and from torch through a same-size unsigned integer view (`RAW_VIEWS`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
from onnx import TensorProto


class ElemType(NamedTuple):
    elem: int  # TensorProto data type
    name: str  # onnxruntime's spelling inside "tensor(...)": the TensorProto name lower-cased
    torch: str  # attribute of the torch module, e.g. "float8_e4m3fn"
    numpy: str  # numpy / ml_dtypes dtype name (the same spellings as torch's)


ELEM_TYPES: tuple[ElemType, ...] = tuple(ElemType(e, n, t, t) for e, n, t in (
    (TensorProto.FLOAT, "float", "float32"),
    (TensorProto.FLOAT16, "float16", "float16"),
    (TensorProto.BFLOAT16, "bfloat16", "bfloat16"),
    (TensorProto.DOUBLE, "double", "float64"),
    (TensorProto.INT8, "int8", "int8"),
    (TensorProto.UINT8, "uint8", "uint8"),
    (TensorProto.INT16, "int16", "int16"),
    (TensorProto.UINT16, "uint16", "uint16"),
    (TensorProto.INT32, "int32", "int32"),
    (TensorProto.UINT32, "uint32", "uint32"),
    (TensorProto.INT64, "int64", "int64"),
    (TensorProto.UINT64, "uint64", "uint64"),
    (TensorProto.BOOL, "bool", "bool"),
    (TensorProto.FLOAT8E4M3FN, "float8e4m3fn", "float8_e4m3fn"),
    (TensorProto.FLOAT8E4M3FNUZ, "float8e4m3fnuz", "float8_e4m3fnuz"),
    (TensorProto.FLOAT8E5M2, "float8e5m2", "float8_e5m2"),
    (TensorProto.FLOAT8E5M2FNUZ, "float8e5m2fnuz", "float8_e5m2fnuz"),
    (TensorProto.COMPLEX64, "complex64", "complex64"),
    (TensorProto.COMPLEX128, "complex128", "complex128"),
))
BY_ELEM: dict[int, ElemType] = {t.elem: t for t in ELEM_TYPES}
_BY_NAME: dict[str, ElemType] = {t.name: t for t in ELEM_TYPES} | {t.numpy: t for t in ELEM_TYPES}

# numpy dtype names numpy itself lacks (ml_dtypes) -> the unsigned integer view of the same width
RAW_VIEWS: dict[str, str] = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e4m3fnuz": "uint8",
                             "float8_e5m2": "uint8", "float8_e5m2fnuz": "uint8"}


# ---- ONNX element type <-> names -----------------------------------------------------------------------

def type_name(elem: int | None) -> str:
    """'float16' for TensorProto.FLOAT16 ('float' for FLOAT, as onnxruntime); 'unknown' for None."""
    if elem is None:
        return "unknown"
    row = BY_ELEM.get(elem)
    if row is not None:
        return row.name
    try:
        return TensorProto.DataType.Name(elem).lower()
    except ValueError:
        return f"undefined({elem})"


def type_str(elem: int) -> str:
    """onnxruntime's NodeArg.type spelling of an element type: 'tensor(float16)'."""
    return f"tensor({type_name(elem)})"


def elem_type(name: str) -> int:
    """The ONNX element type of a type string ('tensor(float)'), an ONNX name ('float', 'float8e4m3fn')
    or a numpy / torch name ('float32', 'float8_e4m3fn')."""
    key = name[len("tensor("):-1] if name.startswith("tensor(") and name.endswith(")") else name
    key = key.replace("torch.", "", 1)
    row = _BY_NAME.get(key)
    if row is None:
        raise KeyError(f"unknown element type {name!r}; known: {sorted(_BY_NAME)}")
    return row.elem


def numpy_name(elem: int) -> str:
    """numpy / torch spelling of an element type: 'float32' for TensorProto.FLOAT."""
    return _row(elem).numpy


# ---- numpy ---------------------------------------------------------------------------------------------

def numpy_dtype(elem: int) -> np.dtype:
    """numpy dtype of an element type (ml_dtypes for bfloat16 / float8)."""
    name = _row(elem).numpy
    if name in RAW_VIEWS:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def elem_type_of_numpy(dtype: Any) -> int:
    """ONNX element type of a numpy dtype (ml_dtypes included); TensorProto.UNDEFINED when none."""
    row = _BY_NAME.get(np.dtype(dtype).name)
    return row.elem if row is not None and row.numpy == np.dtype(dtype).name else TensorProto.UNDEFINED


# ---- torch (imported lazily) ---------------------------------------------------------------------------

@functools.cache
def onnx_to_torch() -> dict[int, Any]:
    """ONNX element type -> torch dtype, for every type torch can hold."""
    import torch

    return {t.elem: getattr(torch, t.torch) for t in ELEM_TYPES if hasattr(torch, t.torch)}


@functools.cache
def torch_to_onnx() -> dict[Any, int]:
    """torch dtype -> ONNX element type."""
    return {v: k for k, v in onnx_to_torch().items()}


def torch_dtype(elem: int | str) -> Any:
    """torch dtype of an element type (int) or of any name `elem_type` reads ('tensor(float16)')."""
    e = elem_type(elem) if isinstance(elem, str) else elem
    try:
        return onnx_to_torch()[e]
    except KeyError:
        raise KeyError(f"element type {type_name(e)} has no torch dtype") from None


def elem_type_of_torch(dtype: Any) -> int:
    """ONNX element type of a torch dtype; TensorProto.UNDEFINED when ONNX has none."""
    return torch_to_onnx().get(dtype, TensorProto.UNDEFINED)


def torch_from_numpy(arr: Any, copy: bool = True) -> Any:
    """numpy array (ml_dtypes bf16 / fp8 included) -> CPU torch tensor of the same element type.
    copy=False shares memory where torch can (writeable, C-contiguous, a dtype torch reads directly)."""
    import torch

    arr = np.asarray(arr)
    raw = RAW_VIEWS.get(arr.dtype.name)
    if raw is not None:
        t = torch.from_numpy(np.array(arr.view(raw), copy=True, order="C"))
        return t.view(getattr(torch, arr.dtype.name))
    if copy or not arr.flags.writeable or not arr.flags.c_contiguous:
        arr = np.array(arr, copy=True, order="C")
    return torch.from_numpy(arr)


def numpy_from_torch(t: Any) -> np.ndarray:
    """A torch tensor as a numpy array (bf16 / fp8 as ml_dtypes arrays); shares memory for CPU tensors."""
    import torch

    t = t.detach().cpu()
    name = str(t.dtype).replace("torch.", "", 1)
    raw = RAW_VIEWS.get(name)
    if raw is not None:
        return t.view(getattr(torch, raw)).numpy().view(numpy_dtype(elem_type(name)))
    return t.numpy()


def _row(elem: int) -> ElemType:
    try:
        return BY_ELEM[elem]
    except KeyError:
        raise KeyError(f"element type {type_name(elem)} is not in pagedkit's dtype table") from None
