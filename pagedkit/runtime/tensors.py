"""numpy <-> torch conversions for the session's numpy API (bf16 / fp8 through ml_dtypes), and ONNX
element-type names as onnxruntime prints them ("tensor(float16)").

Every table behind these lives in pagedkit/interface/dtypes.py; `ONNX_TO_TORCH` / `TORCH_TO_ONNX` are
re-exported (through runtime/ops/util.py) for the session's convenience.
"""

from __future__ import annotations

import numpy as np
import torch

from ..interface import dtypes
from .ops.util import ONNX_TO_TORCH, TORCH_TO_ONNX, tensor_from_proto, torch_dtype

__all__ = ["ONNX_TO_TORCH", "TORCH_TO_ONNX", "tensor_from_proto", "torch_dtype", "to_torch", "to_numpy",
           "type_name", "torch_type_name"]


def type_name(elem_type: int) -> str:
    """'tensor(float16)' for TensorProto.FLOAT16, as onnxruntime's NodeArg.type spells it."""
    return dtypes.type_str(elem_type)


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
    return dtypes.torch_from_numpy(x, copy=copy).to(device)


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A torch tensor as a numpy array (bf16 / fp8 as ml_dtypes arrays); shares memory for CPU tensors."""
    return dtypes.numpy_from_torch(t)
