"""pagedkit.kernels: the attention kernels (com.microsoft::PagedAttention and GroupQueryAttention) and how a
node picks one (docs/kernels.md):
    paged/        PagedAttention on torch: `reference` (the loop-based oracle), the torch variants
                  (`torch_planned`, `torch_sdpa`) and the prologue / cache code they share
    gqa/          GroupQueryAttention on torch: `reference` (the oracle, onnxruntime's semantics) and its cache side
    triton/       the Triton GPU kernels and their variants (triton_paged, triton_mla, sdpa_prefill, triton_gqa)
    onnx_ops/     PagedAttention as standard ONNX ops (for a runtime without a kernel of its own)
    cpu/          PagedAttention as one onnxruntime CPU custom op (C, built once with the system compiler), and
                  the rewrite to it; onnx_facts.py: the static facts both rewrites read
    variant.py    a variant declares what it serves (`KernelVariant`: op, devices, dtypes, features, plans)
    dispatch.py   the variants in priority order; which serve a node (node_facts.py: its static facts) and which
                  runs a call
    quant.py, attention_math.py, scope.py   shared: KV quantization and rotation, the oracle's math, per-run
                  host bookkeeping
Exported here: the two reference kernels, `paged_attention` and `group_query_attention` (imported on first use:
`pagedkit.kernels.cpu.build` serves the torch-free CPU path, runtime/lite, without torch).
"""

from importlib import import_module

_WHERE = {"paged_attention": ".paged.reference", "group_query_attention": ".gqa.reference"}

__all__ = ["group_query_attention", "paged_attention"]


def __getattr__(name):
    if name in _WHERE:
        return getattr(import_module(_WHERE[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
