"""A uniform view of one attention node for the rules: what is known statically or at run time.

The same rules serve `validate_node` (an ONNX node with whatever shapes / dtypes / constant values
shape inference and initializers give) and `check_inputs` (concrete tensors at run time). A dimension
is an int when known, a str when symbolic, None when unknown; rules only report conflicts between
known values, so an unknown symbolic dimension is never an error.
"""

from __future__ import annotations

import sys

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..interface import dtypes
from .contract import OpContract
from .issues import Issue

Dim = int | str | None

# ONNX element type -> onnxruntime's name inside "tensor(...)" (the one table: pagedkit/interface/dtypes.py)
DTYPE_NAMES = {t.elem: t.name for t in dtypes.ELEM_TYPES}
dtype_name = dtypes.type_name  # 'float16' for TensorProto.FLOAT16, 'unknown' for None
type_str = dtypes.type_str  # 'tensor(float16)'
dtype_from_type_str = dtypes.elem_type  # 'tensor(float16)' -> TensorProto.FLOAT16


def onnx_dtype_of(x: Any) -> int:
    """ONNX element type of a torch tensor or numpy array (UNDEFINED when ONNX has none: reported by the
    dtype rule, never a crash)."""
    torch = sys.modules.get("torch")  # a torch tensor implies torch is imported; never import it here
    if torch is not None and isinstance(x, torch.Tensor):
        return dtypes.elem_type_of_torch(x.dtype)
    return dtypes.elem_type_of_numpy(np.asarray(x).dtype)


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
