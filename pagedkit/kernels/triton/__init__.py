"""Triton GPU kernels (planned: the GPU-kernel issues).

Each kernel family will be one file here that declares a dispatch variant (see
`pagedkit/kernels/dispatch.py`): the cache-write prologue, split-KV decode, varlen prefill over the
paged cache and fused MLA decode. Nothing is registered yet; on CUDA the runtime runs `torch_sdpa`.
"""
