"""PagedAttention kernels on torch: `reference` (the loop-based oracle), `prologue` (split, QK-norm,
RoPE, rotation, quantized cache writes; shared by every torch variant), `cache` (cache-side read /
write), `torch_sdpa` (the vectorized CPU/GPU variant)."""
