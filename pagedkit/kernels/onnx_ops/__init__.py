"""PagedAttention as standard ONNX ops (the operator's implementation for a runtime that has no kernel of its
own, e.g. onnxruntime's CPU execution provider): the graph builder (builder.py), the paged-cache half
(paged_cache.py), the prologue and attention (paged_attention.py) and the pass over a model (paged.py).
Public through pagedkit.rewriters.decompose (the rewriter) and runtime/delegate.py (the CPU session's
onnxruntime backend, in_place=True)."""

from .paged import DecomposeReport, decompose

__all__ = ["DecomposeReport", "decompose"]
