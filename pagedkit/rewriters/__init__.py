"""pagedkit.rewriters: ONNX graph passes over onnx-ir.

`decompose` (exported here): every com.microsoft::PagedAttention node as standard ONNX ops, so that stock
onnxruntime runs a paged model (docs/decompose.md). GQA <-> PagedAttention passes: gqa_to_paged.py,
paged_to_gqa.py. The `paged-rewrite` CLI is a separate issue item.
"""

from .decompose import DecomposeReport, decompose

__all__ = ["DecomposeReport", "decompose"]
