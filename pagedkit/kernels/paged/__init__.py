"""PagedAttention kernels on torch: `reference` (the loop-based oracle), `prologue` (split, QK-norm,
RoPE, rotation, quantized cache writes; shared by every torch variant), `cache` (cache-side read /
write), `extents` (the value guard of an unvalidated call), and the variants `torch_planned` (host
bookkeeping planned once per run; the CPU runtime's common decoder node) and `torch_sdpa` (vectorized,
CPU / GPU)."""
