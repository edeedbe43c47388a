"""pagedkit.rewriters.decompose: every valid PagedAttention node of a model rewritten into standard ONNX ops,
run by stock onnxruntime. The implementation lives in the kernels layer (pagedkit/kernels/onnx_ops/paged.py),
which the CPU session's onnxruntime backend also uses; this is its public rewriter entry point."""

from ..kernels.onnx_ops.paged import DecomposeReport, Refused, decompose

__all__ = ["DecomposeReport", "Refused", "decompose"]
