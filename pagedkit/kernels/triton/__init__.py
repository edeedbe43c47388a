"""Triton GPU kernels (CUDA; on CPU through Triton's interpreter in the tests).

Operator variants, each declared in its file and registered in `pagedkit/kernels/dispatch.py`: `paged`
(PagedAttention: the cache-write prologue `cache_write`, split-KV attention `decode`), `mla` (fused LATENT
decode), `sdpa_prefill` (first prompts on torch's fused attention), `gqa` (GroupQueryAttention through the
same kernels over a contiguous cache). Helpers the runtime's fused ops and engine call: `norm` (RMS norms),
`swiglu` (SiluMul), `splitk` (split-K decode products), `argmax` (greedy choices). Shared: `common`.
"""
