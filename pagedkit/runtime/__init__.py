"""pagedkit.runtime: InferenceSession (ONNX on torch, CPU or CUDA) and the KV block manager."""

from .session import InferenceSession, NodeArg

__all__ = ["InferenceSession", "NodeArg"]
