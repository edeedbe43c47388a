"""numpy <-> torch conversions for the session's numpy API (bf16 / fp8 through ml_dtypes), and ONNX
element-type names as onnxruntime prints them ("tensor(float16)").

The ONNX element type <-> torch dtype maps live in one place, `pagedkit/runtime/ops/util.py`
(re-exported here for the session's convenience).
"""

from __future__ import annotations

import numpy as np
import torch

from ..validators.nodeview import type_str
from .ops.util import ONNX_TO_TORCH, TORCH_TO_ONNX, tensor_from_proto, torch_dtype

__all__ = ["ONNX_TO_TORCH", "TORCH_TO_ONNX", "tensor_from_proto", "torch_dtype", "to_torch", "to_numpy",
           "type_name", "torch_type_name"]

# numpy dtypes ml_dtypes provides -> (raw integer view, torch dtype)
_RAW_VIEWS = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
    "float8_e5m2": (np.uint8, torch.float8_e5m2),
}
_TORCH_RAW = {dt: (raw, name) for name, (raw, dt) in _RAW_VIEWS.items()}


def type_name(elem_type: int) -> str:
    """'tensor(float16)' for TensorProto.FLOAT16, as onnxruntime's NodeArg.type spells it."""
    return type_str(elem_type)


def torch_type_name(dtype: torch.dtype) -> str:
    """The ONNX type string of a torch dtype ('tensor(float)' for torch.float32)."""
    elem = TORCH_TO_ONNX.get(dtype)
    return type_name(elem) if elem is not None else str(dtype)


def to_torch(x, device: torch.device | str = "cpu", copy: bool = True) -> torch.Tensor:
    """numpy array (ml_dtypes bf16 / fp8 included), python scalar or list -> torch tensor on `device`.
    copy=True never shares memory with `x` (the caller's array can never be written through it)."""
    if isinstance(x, torch.Tensor):
        t = x.to(device)
        return t.clone() if copy and t is x else t
    arr = np.asarray(x)
    if arr.dtype.name in _RAW_VIEWS:
        raw, dt = _RAW_VIEWS[arr.dtype.name]
        t = torch.from_numpy(np.array(arr.view(raw), copy=True)).view(dt)
    elif copy or not arr.flags.writeable or not arr.flags.c_contiguous:
        t = torch.from_numpy(np.array(arr, copy=True, order="C"))
    else:
        t = torch.from_numpy(arr)
    return t.to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a numpy array (bf16 / fp8 as ml_dtypes arrays); shares memory for CPU tensors."""
    t = t.detach().cpu()
    if t.dtype in _TORCH_RAW:
        import ml_dtypes

        raw, name = _TORCH_RAW[t.dtype]
        return t.view(torch.uint16 if raw is np.uint16 else torch.uint8).numpy().view(getattr(ml_dtypes, name))
    return t.numpy()
