"""pagedkit.kernels: the torch reference kernels and the shared quantization helpers."""

from .reference import paged_attention

__all__ = ["paged_attention"]
