"""PagedAttention on the CPU as one onnxruntime custom op (the onnxruntime CPU backend of runtime/delegate.py):
    paged_attention.c   the kernel (prologue, in-place cache writes, attention) and its registration
    build.py            compiles it once per machine with the system's C compiler (cached)
    lower.py            rewrites the PagedAttention nodes it serves into its nodes
"""
