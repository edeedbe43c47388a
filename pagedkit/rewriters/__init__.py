"""pagedkit.rewriters: ONNX graph passes over onnx-ir.

Implemented: `decompose` (every com.microsoft::PagedAttention node as standard ONNX ops, so that stock
onnxruntime runs a paged model; docs/decompose.md). Planned (open issue): GQA <-> PagedAttention passes
and the `paged-rewrite` CLI.
"""

from .decompose import DecomposeReport, decompose

__all__ = ["DecomposeReport", "decompose"]
