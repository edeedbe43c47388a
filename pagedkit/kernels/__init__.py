"""pagedkit.kernels: the torch reference kernels (the oracle) and the shared quantization helpers."""

from .paged.reference import paged_attention
from .gqa.reference import group_query_attention

__all__ = ["group_query_attention", "paged_attention"]
