"""Triton GPU kernels (CUDA; on CPU through Triton's interpreter in the tests).

Operator variants, each declared in its file and registered in `pagedkit/kernels/dispatch.py`: `paged`
(PagedAttention: the cache-write prologue `cache_write`, split-KV attention `decode`), `mla` (fused LATENT
decode; its launch `mla_decode`), `sdpa_prefill` (first prompts on torch's fused attention), `gqa`
(GroupQueryAttention through the same kernels over a contiguous cache; windowed caches `gqa_window`, what both
share `gqa_common`). `ops`: the kernels as torch.library custom ops. Helpers the runtime's fused ops and engine
call: `norm` (RMS norms), `swiglu` (SiluMul), `argmax` (greedy choices).
Shared: `common`; the @triton.jit kernels themselves: `_decode_kernels`, `_mla_kernels`, `_rope_quant`.
"""
