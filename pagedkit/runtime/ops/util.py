"""Helpers the op families share: ONNX element types as torch dtypes, TensorProto -> tensor, host ints."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto

from ...interface import dtypes

# ONNX element type <-> torch dtype: the one table of pagedkit/interface/dtypes.py (types torch can hold;
# others raise in torch_dtype)
ONNX_TO_TORCH: dict[int, torch.dtype] = dtypes.onnx_to_torch()
TORCH_TO_ONNX: dict[torch.dtype, int] = dtypes.torch_to_onnx()
HALF_TYPES = (torch.float16, torch.bfloat16)


def torch_dtype(onnx_type: int, what: str = "element type") -> torch.dtype:
    try:
        return ONNX_TO_TORCH[onnx_type]
    except KeyError:
        try:
            name = onnx.helper.tensor_dtype_to_string(onnx_type)
        except (KeyError, ValueError):  # UNDEFINED (0) and numbers ONNX does not define
            name = TensorProto.DataType.Name(onnx_type) if onnx_type in TensorProto.DataType.values() else onnx_type
        raise NotImplementedError(f"{what} {name} has no torch equivalent in the pagedkit runtime") from None


# 4-bit integer tensors (GatherBlockQuantized data / zero points): torch's int4 / uint4 dtypes hold no
# arithmetic, so they are storage only, one value per byte (ml_dtypes' layout); ops read them through a
# view as int8 / uint8 (`t.view(torch.int8)`)
INT4_TYPES: dict[int, tuple[torch.dtype, torch.dtype]] = {
    TensorProto.INT4: (torch.int4, torch.int8), TensorProto.UINT4: (torch.uint4, torch.uint8)}


def int4_from_bytes(raw: np.ndarray, data_type: int, dims) -> torch.Tensor:
    """ONNX INT4 / UINT4 raw data (two values per byte, the first in the low nibble) as the runtime's
    torch.int4 / torch.uint4 tensor (one value per byte, INT4 sign-extended)."""
    four, byte = INT4_TYPES[data_type]
    n = int(np.prod(dims))
    v = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(-1)[:n]
    if data_type == TensorProto.INT4:
        v = ((v.astype(np.int16) ^ 8) - 8).astype(np.int8)
    return torch.from_numpy(np.ascontiguousarray(v)).reshape(tuple(dims)).view(four)


def tensor_from_proto(proto: onnx.TensorProto, device: torch.device | str = "cpu") -> torch.Tensor:
    """An ONNX TensorProto (Constant value, ConstantOfShape value, initializer) as a torch tensor
    (INT4 / UINT4: a torch.int4 / torch.uint4 tensor, one value per byte, see INT4_TYPES)."""
    what = f"tensor {proto.name or '(attribute)'}"
    if proto.data_type in INT4_TYPES:
        four, byte = INT4_TYPES[proto.data_type]
        arr = onnx.numpy_helper.to_array(proto)
        values = np.ascontiguousarray(arr.astype(str(byte).removeprefix("torch.")))  # sign-extended (int4)
        return torch.from_numpy(values).view(four).to(device)
    dtype = torch_dtype(proto.data_type, what)  # NotImplementedError: no torch type (UNDEFINED, STRING, ...)
    try:
        arr = onnx.numpy_helper.to_array(proto)
    except (TypeError, ValueError) as exc:  # a malformed tensor: data that does not match its dims / type
        raise ValueError(f"{what}: {exc}") from None
    # ml_dtypes arrays (bfloat16, float8 variants) move through their raw integer view
    return dtypes.torch_from_numpy(arr).to(device=device, dtype=dtype)


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


@functools.cache
def triton_kernels(name: str):
    """The kernel module pagedkit.kernels.triton.<name> when Triton is usable here, else None (the caller
    keeps its torch composition). Imported on first use: the CPU runtime never needs Triton."""
    try:
        mod = importlib.import_module(f"pagedkit.kernels.triton.{name}")
    except ImportError:  # pragma: no cover - machines without triton
        return None
    return mod if mod.common.HAVE_TRITON else None
