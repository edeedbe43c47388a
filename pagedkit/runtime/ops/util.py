"""Helpers the op families share: ONNX element types as torch dtypes, TensorProto -> tensor, host ints."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto

# ONNX element type -> torch dtype (the types torch can hold; others raise in torch_dtype)
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.UINT16: torch.uint16,
    TensorProto.INT32: torch.int32,
    TensorProto.UINT32: torch.uint32,
    TensorProto.INT64: torch.int64,
    TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
    TensorProto.FLOAT8E5M2: torch.float8_e5m2,
    TensorProto.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    TensorProto.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
}
TORCH_TO_ONNX: dict[torch.dtype, int] = {v: k for k, v in ONNX_TO_TORCH.items()}
HALF_TYPES = (torch.float16, torch.bfloat16)


def torch_dtype(onnx_type: int, what: str = "element type") -> torch.dtype:
    try:
        return ONNX_TO_TORCH[onnx_type]
    except KeyError:
        known = onnx_type in TensorProto.DataType.values()
        name = onnx.helper.tensor_dtype_to_string(onnx_type) if known else onnx_type
        raise NotImplementedError(f"{what} {name} has no torch equivalent in the pagedkit runtime") from None


def tensor_from_proto(proto: onnx.TensorProto, device: torch.device | str = "cpu") -> torch.Tensor:
    """An ONNX TensorProto (Constant value, ConstantOfShape value, initializer) as a torch tensor."""
    arr = onnx.numpy_helper.to_array(proto)
    dtype = torch_dtype(proto.data_type, f"tensor {proto.name or '(attribute)'}")
    if arr.dtype.kind not in "biuf" or arr.dtype.name == "bfloat16" or "float8" in arr.dtype.name:
        # ml_dtypes arrays (bfloat16, float8 variants): reinterpret the bytes
        raw = np.ascontiguousarray(arr).view(np.uint8 if dtype.itemsize == 1 else np.int16)
        return torch.from_numpy(raw.copy()).view(dtype).to(device)
    return torch.from_numpy(np.array(arr, copy=True)).to(device=device, dtype=dtype)


def host_ints(t: torch.Tensor | None, what: str) -> list[int]:
    """A shape-like int tensor read on the host (scalar -> one-element list)."""
    if t is None:
        raise ValueError(f"{what}: required shape-like input is missing")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"{what}: expected an integer tensor, got {t.dtype}")
    v = t.tolist()
    return v if isinstance(v, list) else [v]


def host_scalar(t: torch.Tensor, what: str) -> Any:
    if t.numel() != 1:
        raise ValueError(f"{what}: expected a single value, got shape {list(t.shape)}")
    return t.reshape(()).tolist()


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ValueError(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def axes_from(inputs: list, index: int, attrs: dict, what: str) -> list[int] | None:
    """Axes given as input `index` (newer opsets) or as attribute 'axes' (older ones); None if neither."""
    t = inputs[index] if len(inputs) > index else None
    if t is not None:
        return host_ints(t, what)
    return list(attrs["axes"]) if "axes" in attrs else None


def opt(inputs: list, index: int) -> torch.Tensor | None:
    return inputs[index] if len(inputs) > index else None


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types (norms, softmax and their statistics upcast), else the dtype itself."""
    return torch.float32 if dtype in HALF_TYPES else dtype
