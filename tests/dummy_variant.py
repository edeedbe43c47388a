"""A test-support kernel variant, declared in this one file: `dispatch.register_variant("dummy_variant:VARIANT")`
adds it (tests/test_dispatch.py). It claims a narrow slice of PagedAttention (CPU, float16, unquantized
caches, known head size <= 32, the "decode" plan only) and declares itself capturable — a claim made for the
tests of the capturable requirement, not a property of the code, which delegates to the loop-based reference
(so its results are the reference's) and records every call.
"""

from __future__ import annotations

from pagedkit.kernels.paged import reference
from pagedkit.kernels.variant import KernelVariant

CALLS: list[dict] = []  # one entry per call: the validate flag and the inputs given


def _supports(info) -> str | None:
    if info.head_size is None or info.head_size > 32:
        return f"serves a static head_size <= 32, the node's is {info.head_size}"
    return None


def paged_attention(inputs, *, outputs=None, validate=True, **attributes):
    CALLS.append({"validate": validate, "inputs": sorted(inputs)})
    return reference.paged_attention(inputs, outputs=outputs, validate=validate, **attributes)


VARIANT = KernelVariant(
    name="dummy_decode",
    op="PagedAttention",
    entry=paged_attention,
    devices=("cpu",),
    dtypes=("float16",),
    capturable=True,
    features=("rotary", "packed_qkv", "slot_mapping", "attention_metadata"),
    supports=_supports,
    plans=("decode",),
    description="Test double (tests/dummy_variant.py): the reference behind a narrow declaration.",
    limits="head_size <= 32 (static).",
)
