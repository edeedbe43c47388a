"""pagedkit.rewriters: ONNX graph passes over onnx-ir.

- `gqa_to_paged` / `paged_to_gqa`: whole onnxruntime-genai decoders between GroupQueryAttention and
  PagedAttention (node-level rule sets in node_rules/: to_paged.py, to_gqa.py), docs/rewrite.md;
- `decompose`: every com.microsoft::PagedAttention node as standard ONNX ops, so that stock onnxruntime
  runs a paged model, docs/decompose.md;
- `rewrite_file`: what the `paged-rewrite` CLI runs (safe loading, rewrite, validation, genai_config.json).
"""

from .decompose import DecomposeReport, decompose
from .gqa_to_paged import gqa_to_paged
from .paged_to_gqa import paged_to_gqa
from .report import RewriteRefused, RewriteReport
from .rewrite import rewrite_file, rewrite_model

__all__ = ["DecomposeReport", "RewriteRefused", "RewriteReport", "decompose", "gqa_to_paged", "paged_to_gqa",
           "rewrite_file", "rewrite_model"]
