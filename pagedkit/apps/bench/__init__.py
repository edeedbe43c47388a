"""paged-bench: decode tokens/s and time to first token, pagedkit's engine against onnxruntime and the
bandwidth floor (see docs/bench.md)."""
