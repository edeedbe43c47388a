"""A uniform view of one attention node for the rules: what is known statically or at run time.

The same rules serve `validate_node` (an ONNX node with whatever shapes / dtypes / constant values
shape inference and initializers give) and `check_inputs` (concrete tensors at run time). A dimension
is an int when known, a str when symbolic, None when unknown; rules only report conflicts between
known values, so an unknown symbolic dimension is never an error.
"""

from __future__ import annotations

import functools
import sys

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto

from .contract import OpContract
from .issues import Issue

Dim = int | str | None

DTYPE_NAMES = {
    TensorProto.FLOAT: "float",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.DOUBLE: "double",
    TensorProto.INT8: "int8",
    TensorProto.UINT8: "uint8",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.FLOAT8E4M3FN: "float8e4m3fn",
    TensorProto.BOOL: "bool",
}
_NAME_TO_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: int | None) -> str:
    if dtype is None:
        return "unknown"
    return DTYPE_NAMES.get(dtype, onnx.helper.tensor_dtype_to_string(dtype).replace("TensorProto.", "").lower())


def type_str(dtype: int) -> str:
    """ONNX type string of an element type, e.g. 'tensor(float16)'."""
    return f"tensor({dtype_name(dtype)})"


def dtype_from_type_str(s: str) -> int:
    return _NAME_TO_DTYPE[s[len("tensor("):-1]]


def onnx_dtype_of(x: Any) -> int:
    """ONNX element type of a torch tensor or numpy array."""
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported; never import it here
    if torch is not None and isinstance(x, torch.Tensor):
        # an element type ONNX cannot express is UNDEFINED (reported by the dtype rule), never a crash
        return _torch_map().get(x.dtype, TensorProto.UNDEFINED)
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":
        return TensorProto.BFLOAT16
    if arr.dtype.name == "float8_e4m3fn":
        return TensorProto.FLOAT8E4M3FN
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(arr.dtype)
    except Exception:
        return TensorProto.UNDEFINED


@functools.cache
def _torch_map() -> dict:
    import torch

    return {
        torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
        torch.float64: TensorProto.DOUBLE, torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
        torch.int32: TensorProto.INT32, torch.int64: TensorProto.INT64, torch.bool: TensorProto.BOOL,
        torch.float8_e4m3fn: TensorProto.FLOAT8E4M3FN, torch.int16: TensorProto.INT16,
        torch.float8_e5m2: TensorProto.FLOAT8E5M2, torch.complex64: TensorProto.COMPLEX64,
    }



def _values_of(x: Any) -> np.ndarray | None:
    """Concrete values of small integer index tensors (for value rules); None for float data."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype in (torch.int32, torch.int64):
            return x.detach().cpu().numpy()
        return None
    arr = np.asarray(x)
    return arr if arr.dtype.kind in "iu" else None


@dataclass
class TensorInfo:
    """What is known about one tensor. value holds integer contents when known (runtime or constant)."""

    name: str
    dtype: int | None = None
    shape: tuple[Dim, ...] | None = None
    value: np.ndarray | None = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)

    def dim(self, i: int) -> Dim:
        if self.shape is None or i >= len(self.shape) or i < -len(self.shape):
            return None
        return self.shape[i]

    @classmethod
    def of(cls, name: str, x: Any) -> "TensorInfo":
        """From a concrete torch tensor or numpy array (anything else is viewed through numpy)."""
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = np.asarray(x)
        return cls(name, onnx_dtype_of(x), tuple(int(d) for d in x.shape), _values_of(x))


def known(d: Dim) -> bool:
    return isinstance(d, int) and not isinstance(d, bool)


def dims_conflict(a: Dim, b: Dim) -> bool:
    """True only when both dims are known ints and differ (symbolic or unknown never conflict)."""
    return known(a) and known(b) and a != b


@dataclass
class NodeView:
    contract: OpContract
    node_name: str
    attrs: dict[str, Any]  # attributes explicitly set on the node
    inputs: dict[int, TensorInfo]  # present inputs by contract index
    outputs: dict[int, TensorInfo] | None  # present outputs by index; None = not known (runtime call)
    num_inputs: int = 0  # length of the node's input list (including empty names)
    num_outputs: int | None = None
    runtime: bool = False  # concrete tensors: every shape and dtype known
    extra: list[Issue] = field(default_factory=list)  # issues found while building the view

    def a(self, name: str) -> Any:
        """Attribute value, falling back to the contract default."""
        if name in self.attrs:
            return self.attrs[name]
        return self.contract.attr(name).default

    def has(self, name: str) -> bool:
        return self.contract.input_index(name) in self.inputs

    def t(self, name: str) -> TensorInfo | None:
        return self.inputs.get(self.contract.input_index(name))

    def has_output(self, name: str) -> bool | None:
        """Whether the output is requested; None when outputs are unknown."""
        if self.outputs is None:
            return None
        return self.contract.output_index(name) in self.outputs

    def out(self, name: str) -> TensorInfo | None:
        if self.outputs is None:
            return None
        return self.outputs.get(self.contract.output_index(name))

    def issue(self, where: str, rule: str, expected: Any, got: Any, message: str = "") -> Issue:
        return Issue(self.node_name or self.contract.name, where, rule, str(expected), str(got), message)

    @classmethod
    def from_tensors(
        cls,
        contract: OpContract,
        inputs: Mapping[str, Any],
        attrs: Mapping[str, Any],
        outputs: Sequence[str] | None = None,
        node_name: str = "",
    ) -> "NodeView":
        """Runtime view: inputs keyed by ONNX input name (None or missing = absent)."""
        extra = []
        view_inputs: dict[int, TensorInfo] = {}
        for key, x in inputs.items():
            if x is None:
                continue
            try:
                idx = contract.input_index(key)
            except KeyError:
                extra.append(Issue(node_name or contract.name, f"input '{key}'", "unknown-input",
                                   f"one of {list(contract.input_names)}", repr(key),
                                   f"Input '{key}' is not an input of {contract.name}"))
                continue
            view_inputs[idx] = TensorInfo.of(key, x)
        outs = None
        if outputs is not None:
            outs = {}
            for key in outputs:
                try:
                    outs[contract.output_index(key)] = TensorInfo(key)
                except KeyError:
                    extra.append(Issue(node_name or contract.name, f"output '{key}'", "unknown-output",
                                       f"one of {list(contract.output_names)}", repr(key),
                                       f"Output '{key}' is not an output of {contract.name}"))
        num_inputs = max(view_inputs, default=-1) + 1
        num_outputs = None if outs is None else max(outs, default=-1) + 1
        return cls(contract, node_name, dict(attrs), view_inputs, outs, num_inputs, num_outputs, True, extra)
