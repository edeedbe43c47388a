"""Conversions between ONNX element types, numpy arrays and torch tensors (bf16 / fp8 included)."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto

ONNX_TO_TORCH = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32,
    TensorProto.INT64: torch.int64,
    TensorProto.BOOL: torch.bool,
    TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn,
}
TORCH_TO_ONNX = {v: k for k, v in ONNX_TO_TORCH.items()}


def torch_dtype(elem_type: int) -> torch.dtype:
    try:
        return ONNX_TO_TORCH[elem_type]
    except KeyError:
        raise TypeError(f"element type {onnx.helper.tensor_dtype_to_string(elem_type)} is not supported") from None


def to_torch(x, device: torch.device | str = "cpu", copy: bool = True) -> torch.Tensor:
    """numpy array (bf16 / fp8 from ml_dtypes included) or python scalar -> torch tensor on device."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    arr = np.array(x, copy=True) if copy else np.asarray(x)
    if not arr.flags.writeable:
        arr = arr.copy()
    name = arr.dtype.name
    if name == "bfloat16":
        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16)).view(torch.bfloat16)
    elif name == "float8_e4m3fn":
        t = torch.from_numpy(np.ascontiguousarray(arr).view(np.uint8)).view(torch.float8_e4m3fn)
    else:
        t = torch.from_numpy(np.ascontiguousarray(arr)) if arr.ndim else torch.tensor(arr)
    return t.to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        import ml_dtypes

        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return t.numpy()


def initializer_to_torch(proto: onnx.TensorProto, base_dir: str | None = None) -> torch.Tensor:
    arr = onnx.numpy_helper.to_array(proto, base_dir or "")
    return to_torch(arr, copy=True)
