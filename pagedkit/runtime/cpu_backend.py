"""Which backend runs a CPU session (docs/cpu.md, the rule): `cpu_backend=` as given, else PAGEDKIT_CPU_BACKEND, else
the caller's default ("torch" for InferenceSession; "auto" for Generator, paged-run and the engine), and what "auto"
picks for a model."""

from __future__ import annotations

import onnx

from .. import settings
from .delegate import onnxruntime_available

CPU_BACKENDS = ("onnxruntime", "torch", "auto")
_HALF_WEIGHTS = 1 << 20  # auto: a float16 / bfloat16 initializer of this many elements is what the rule looks at


def _cpu_backend(value: str | None, default: str = "torch") -> str:
    """cpu_backend as given, else the environment variable PAGEDKIT_CPU_BACKEND, else `default` ("onnxruntime"
    falls back to "torch" when onnxruntime is not installed)."""
    if value is None:
        value = settings.read("PAGEDKIT_CPU_BACKEND") or default
        if value == "onnxruntime" and not onnxruntime_available():
            return "torch"
    if value not in CPU_BACKENDS:
        raise ValueError(f"cpu_backend: expected one of {list(CPU_BACKENDS)}, got {value!r}")
    return value


def _auto_backend(model: onnx.ModelProto) -> str:
    """"auto" (docs/runtime.md, the CPU rule): onnxruntime for models whose weights are float32 or quantized, and
    for float16 PagedAttention models it can widen to float32 outside attention (kernels/cpu/widen.py: exact
    weights, float32 activations; SmolLM2-135M: the float32 export's speed, 2.4x torch's float16); torch for the
    other float16 / bfloat16 models (GroupQueryAttention caches bind their activations' type; numpy has no
    bfloat16 for onnxruntime's boundaries), which it keeps once."""
    if not onnxruntime_available():
        return "torch"
    from ..kernels.cpu.widen import why_not

    half = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    for t in model.graph.initializer:
        n = 1
        for d in t.dims:
            n *= int(d)
        if t.data_type in half and n >= _HALF_WEIGHTS:
            return "onnxruntime" if t.data_type == onnx.TensorProto.FLOAT16 and why_not(model) is None else "torch"
    return "onnxruntime"


__all__ = ["CPU_BACKENDS"]
