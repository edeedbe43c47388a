"""The static facts of an attention node that kernel dispatch decides on (`NodeInfo`, built by `node_info`):
attributes, present inputs / outputs, element types and shapes from the model's value_info, the dims the
validator derives from them (validators/rules: paged_dims, gqa_dims), the device; never tensor values.

Below both `variant.py` (a variant's `supports(info)` and `KernelVariant.refusal(info)` read a NodeInfo) and
`dispatch.py` (which builds one per node and re-exports `NodeInfo` / `node_info`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import onnx
import torch

from ..validators.checks import view_of_node
from ..validators.contract import get_contract


@dataclass
class NodeInfo:
    """What dispatch knows about a node: static only (attributes, present inputs / outputs, element types
    and shapes from the model's value_info, the dims the validator derives from them, the device).
    A dim is None when unknown (symbolic, or not derivable)."""

    op_type: str
    attrs: dict[str, Any]
    present_inputs: set[str]
    present_outputs: set[str]
    device: torch.device
    node_name: str = ""
    dtypes: dict[str, str] = field(default_factory=dict)  # contract input name -> ONNX element type name
    shapes: dict[str, tuple | None] = field(default_factory=dict)  # contract input name -> static shape
    t_dtype: str | None = None  # element type bound to T (query's)
    num_heads: int | None = None
    kv_num_heads: int | None = None
    head_size: int | None = None
    v_head_size: int | None = None  # effective V head size (LATENT: v_head_size)
    block_size: int | None = None  # PagedAttention
    num_blocks: int | None = None
    max_blocks: int | None = None  # block_table.shape[1]
    layout: str | None = None  # "SEPARATE" / "LATENT" (PagedAttention)
    input_mode: str | None = None  # "unpacked" / "packed" / "latent"
    k_cache_format: str | None = None  # a CACHE_FORMATS name ("float16", "int8", "int4", ...) or the T name
    v_cache_format: str | None = None

    def attr(self, name: str) -> Any:
        if name in self.attrs:
            return self.attrs[name]
        return get_contract(self.op_type).attr(name).default

    @property
    def features(self) -> frozenset[str]:
        """The node's features (variant.FEATURES names), from attributes, presence and cache formats."""
        ins, a = self.present_inputs, self.attr
        f = set()
        for name in ("head_sink", "attention_bias", "slot_mapping", "query_positions", "attention_metadata",
                     "position_ids", "query_seqlens"):
            if name in ins:
                f.add(name)
        if "q_norm_weight" in ins or "k_norm_weight" in ins:
            f.add("qk_norm")
        if int(a("do_rotary") or 0):
            f.add("rotary")
        if float(a("softcap") or 0) > 0:
            f.add("softcap")
        if int(a("local_window_size") or -1) > 0:
            f.add("local_window")
        if int(a("qk_output") or 0) or "output_qk" in self.present_outputs:
            f.add("output_qk")
        for side in (self.k_cache_format, self.v_cache_format):
            kind = {"int8": "int8_cache", "float8e4m3fn": "fp8_cache", "int4": "int4_cache"}.get(side or "")
            if kind:
                f.add(kind)
        if self.op_type == "PagedAttention":
            latent = a("kv_cache_layout") == "LATENT"
            if latent:
                f.add("latent_cache")
            elif "key" not in ins and "value" not in ins:
                f.add("packed_qkv")
            if not int(a("is_causal")):
                f.add("non_causal")
            if int(a("qk_rotation") or 0) or int(a("v_rotation") or 0):
                f.add("hadamard_rotation")
            if "PER_TOKEN" in (a("k_quant_type"), a("v_quant_type")):
                f.add("per_token_scales")
        else:
            if "key" not in ins:
                f.add("packed_qkv")
            if not int(a("causal")):
                f.add("non_causal")
            if int(a("smooth_softmax") or 0) == 1:
                f.add("smooth_softmax")
            key_shape = self.shapes.get("key")
            if key_shape is not None and len(key_shape) == 3 and key_shape[1] == 0:
                f.add("shared_kv")
            bits = int(a("kv_cache_bit_width") or 0)
            if bits == 4:
                f.add("int4_cache")
            elif bits == 8:
                f.add("fp8_cache" if self.dtypes.get("past_key") == "float8e4m3fn" else "int8_cache")
        return frozenset(f)


def _known(d: Any) -> int | None:
    return d if isinstance(d, int) and not isinstance(d, bool) else None


def node_info(node: onnx.NodeProto, device: torch.device,
              value_info: Mapping[str, tuple] | None = None) -> NodeInfo:
    """NodeInfo of an ONNX node from the model's value_info (name -> (elem type, shape)); no values."""
    from ..validators.nodeview import dtype_name

    contract = get_contract(node.op_type)
    view = view_of_node(node, value_info or {}, None)
    ins = {contract.inputs[i].name for i in view.inputs}
    outs = {contract.outputs[i].name for i in (view.outputs or {})}
    dtypes = {t_name: dtype_name(t.dtype) for i, t in view.inputs.items()
              if t.dtype and (t_name := contract.inputs[i].name)}
    shapes = {contract.inputs[i].name: t.shape for i, t in view.inputs.items()}
    info = NodeInfo(node.op_type, dict(view.attrs), ins, outs, device, node_name=node.name or node.op_type,
                    dtypes=dtypes, shapes=shapes)
    if node.op_type == "PagedAttention":
        from ..validators.rules.paged_dims import paged_dims

        d = paged_dims(view)
        info.t_dtype, info.num_heads, info.kv_num_heads = d.t_dtype, d.nh, d.kv
        info.head_size, info.v_head_size, info.block_size = d.head_size, d.eff_v, d.block_size
        info.num_blocks, info.max_blocks, info.layout, info.input_mode = d.num_blocks, d.max_blocks, d.layout, d.mode
        for side, cache in (("k", "key_cache"), ("v", "value_cache")):
            fmt = info.attr(f"{side}_cache_dtype") or dtypes.get(cache)
            if side == "v" and d.layout == "LATENT":
                fmt = info.k_cache_format
            setattr(info, f"{side}_cache_format", fmt)
    else:
        from ..validators.rules.gqa import gqa_dims

        d = gqa_dims(view)
        info.t_dtype, info.num_heads, info.kv_num_heads = d.t_dtype, d.nh, d.kv
        info.head_size = info.v_head_size = d.head_size
        bits = int(info.attr("kv_cache_bit_width") or 0)
        fmt = {4: "int4", 8: "float8e4m3fn" if dtypes.get("past_key") == "float8e4m3fn" else "int8"}.get(
            bits, dtypes.get("past_key"))
        info.k_cache_format = info.v_cache_format = fmt
    for key in ("num_heads", "kv_num_heads", "head_size", "v_head_size", "block_size", "num_blocks", "max_blocks"):
        setattr(info, key, _known(getattr(info, key)))
    return info
