"""pagedkit: a toolkit for ONNX Runtime's com.microsoft::PagedAttention and GroupQueryAttention.

Public API (imported lazily so that `paged-validate` does not pay for torch):
    pagedkit.InferenceSession      onnxruntime-like session on torch (runtime/)
    pagedkit.validators            contracts, validate_node / validate_model / check_inputs
    pagedkit.kernels               reference kernels: paged_attention, group_query_attention
"""

__version__ = "0.1.0"

__all__ = ["InferenceSession", "SessionOptions", "__version__"]


def __getattr__(name):
    if name in ("InferenceSession", "SessionOptions"):
        from .runtime import session

        return getattr(session, name)
    raise AttributeError(f"module 'pagedkit' has no attribute {name!r}")
