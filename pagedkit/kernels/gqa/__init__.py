"""GroupQueryAttention kernels on torch: `reference` (the oracle, following onnxruntime's semantics)
and `cache` (the padded past/present cache side, int8/int4 quantized)."""
