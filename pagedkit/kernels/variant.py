"""Kernel variant declarations: what one variant serves, as data.

Each variant module exports ONE `VARIANT = KernelVariant(...)`; `kernels/dispatch.py` lists them as lazy
"module:VARIANT" strings in priority order and `docs/kernels.md` is generated from them
(`python -m pagedkit.kernels.docs`). A variant declares:

- `op`: the operator it implements ("PagedAttention" or "GroupQueryAttention");
- `devices`: torch device types it runs on ("cpu", "cuda");
- `dtypes`: element types of T (query / output) it serves, ONNX spellings ("float16", "bfloat16", "float");
- `features`: the node features it serves (names of `FEATURES`; a node using any other is refused,
  the refusal naming the feature);
- `capturable`: whether one call is CUDA-graph capturable (no host reads of device values, no
  allocation that depends on values). A session created with `capturable=True` refuses a node whose
  only serving variants are not;
- `plans`: the per-run plan kinds it serves (`PLANS`); a run's plan hint (host-side information only)
  picks, among the variants that serve the node, the first that serves that plan;
- `supports(info) -> reason | None`: any further static limit (head size, block size...), decided from
  `node_facts.NodeInfo` (static shapes, dtypes, attributes; never tensor values);
- `entry`: `fn(inputs: dict[name, tensor], *, outputs: list[str], validate: bool, **attributes) -> dict`,
  a callable or "module:function" (a module starting with "." is relative to pagedkit.kernels);
- `stages_on_cpu`: runs on CPU copies of device tensors (the loop-based reference); such a variant
  serves a non-CPU device only as the reference fallback (contract-decisions §9).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from .node_facts import NodeInfo

# feature name -> what uses it (the node's static facts that node_facts.NodeInfo.features derives)
FEATURES: dict[str, str] = {
    "packed_qkv": "query carries Q, K and V packed (key / value absent)",
    "latent_cache": "kv_cache_layout LATENT (MLA: one latent cache, V = its leading v_head_size channels)",
    "rotary": "do_rotary=1 (RoPE in the prologue; cos_cache / sin_cache)",
    "qk_norm": "q_norm_weight / k_norm_weight (per-head RMS QK-norm before RoPE)",
    "softcap": "softcap > 0",
    "local_window": "local_window_size > 0 (sliding window)",
    "non_causal": "is_causal=0 (PagedAttention) / causal=0 (GroupQueryAttention)",
    "head_sink": "head_sink input",
    "attention_bias": "attention_bias input",
    "output_qk": "output_qk requested (qk_output != 0)",
    "slot_mapping": "slot_mapping input (explicit write slots)",
    "query_positions": "query_positions input (positions independent of past_seqlens)",
    "attention_metadata": "attention_metadata input (host-side bounds)",
    "hadamard_rotation": "qk_rotation / v_rotation (Walsh-Hadamard rotation of the cached channels)",
    "int8_cache": "an int8 cache (PER_TENSOR / PER_CHANNEL / PER_TOKEN scales)",
    "fp8_cache": "a float8e4m3fn cache",
    "int4_cache": "an int4 cache (uint8, two +8-biased nibbles per byte)",
    "per_token_scales": "PER_TOKEN quantization with k_scale_cache / v_scale_cache",
    "position_ids": "GroupQueryAttention position_ids input",
    "query_seqlens": "GroupQueryAttention query_seqlens input",
    "smooth_softmax": "GroupQueryAttention smooth_softmax=1",
    "shared_kv": "GroupQueryAttention key / value with 0 rows (attends to the past only)",
}

# feature names that can occur on each op
OP_FEATURES: dict[str, tuple[str, ...]] = {
    "PagedAttention": ("packed_qkv", "latent_cache", "rotary", "qk_norm", "softcap", "local_window", "non_causal",
                       "head_sink", "attention_bias", "output_qk", "slot_mapping", "query_positions",
                       "attention_metadata", "hadamard_rotation", "int8_cache", "fp8_cache", "int4_cache",
                       "per_token_scales"),
    "GroupQueryAttention": ("packed_qkv", "rotary", "qk_norm", "softcap", "local_window", "non_causal", "head_sink",
                            "attention_bias", "output_qk", "int8_cache", "fp8_cache", "int4_cache", "position_ids",
                            "query_seqlens", "smooth_softmax", "shared_kv"),
}

# per-run plan kinds (host-side information the caller or the engine's plan knows); "mixed" is the
# general case (anything: prefill, decode, chunked prefill, speculative steps in one call) and is what
# a run without a hint needs
PLANS: dict[str, str] = {
    "mixed": "anything (no hint): prefills, decodes, chunks and speculative steps in one call; a variant "
             "serving mixed serves every hint",
    "decode": "every sequence adds a few tokens (decode, speculative drafts) over its cached context",
    "prefill": "first prompts: no sequence has a cached prefix (past_seqlens all 0)",
    "chunked_prefill": "prompt chunks over a cached prefix",
}

DTYPES = ("float16", "bfloat16", "float")


@dataclass(frozen=True)
class KernelVariant:
    name: str
    op: str
    entry: str | Callable
    devices: tuple[str, ...]
    dtypes: tuple[str, ...]
    capturable: bool
    features: tuple[str, ...]
    supports: Callable[["NodeInfo"], str | None] | None = None
    plans: tuple[str, ...] = ("mixed",)
    stages_on_cpu: bool = False
    description: str = ""
    limits: str = ""  # what `supports` refuses, in words (for docs/kernels.md)
    not_capturable_because: str = ""
    _fn: list = field(default_factory=list, repr=False, compare=False)  # resolved entry (cache)

    def __post_init__(self):
        unknown = [f for f in self.features if f not in FEATURES]
        if unknown:
            raise ValueError(f"variant {self.name!r}: unknown feature(s) {unknown}; known: {sorted(FEATURES)}")
        bad_plans = [p for p in self.plans if p not in PLANS]
        if bad_plans:
            raise ValueError(f"variant {self.name!r}: unknown plan(s) {bad_plans}; known: {list(PLANS)}")
        if not self.capturable and not self.not_capturable_because:
            raise ValueError(f"variant {self.name!r}: say why it is not capturable (not_capturable_because)")

    def load(self) -> Callable:
        """The entry function (imported on first use)."""
        if not self._fn:
            fn = self.entry
            if isinstance(fn, str):
                module, _, attr = fn.partition(":")
                mod = importlib.import_module(module, "pagedkit.kernels" if module.startswith(".") else None)
                fn = getattr(mod, attr)
            self._fn.append(fn)
        return self._fn[0]

    def serves_plan(self, plan: str | None) -> bool:
        return "mixed" in self.plans or (plan or "mixed") in self.plans

    def refusal(self, info: "NodeInfo") -> str | None:
        """None when the declaration (and `supports`) serves the node, else the reason it does not."""
        if info.op_type != self.op:
            return f"serves com.microsoft::{self.op} only, not {info.op_type}"
        if info.device.type not in self.devices:
            return f"runs on {' / '.join(self.devices)} only, not {info.device.type}"
        if info.t_dtype is not None and info.t_dtype not in self.dtypes:
            return f"serves T in {{{', '.join(self.dtypes)}}}, not {info.t_dtype}"
        missing = sorted(set(info.features) - set(self.features))
        if missing:
            return f"does not serve feature(s) {', '.join(missing)}"
        if self.supports is not None:
            return self.supports(info)
        return None

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "op": self.op, "devices": list(self.devices), "dtypes": list(self.dtypes),
                "capturable": self.capturable, "plans": list(self.plans), "features": list(self.features)}
