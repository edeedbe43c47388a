"""pagedkit: a toolkit for ONNX Runtime's com.microsoft::PagedAttention and GroupQueryAttention."""

__version__ = "0.1.0"
