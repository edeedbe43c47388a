"""Corrections pagedkit applies to onnxruntime-genai builder models before the paged rewrite (`--via genai`),
and the window check. Each one is measured against Hugging Face eager (tests/test_export_via_genai.py).

- every model: the builder's `SimplifiedLayerNormalization` (an onnxruntime contrib op it writes in the
  default ONNX domain, which onnx.checker rejects) becomes ONNX `RMSNormalization` (opset 23, what the
  native route writes): the same math, y = x / sqrt(mean(x^2) + epsilon) * scale computed in float32
  (stash_type 1); the default-domain opset import is raised to 23 (no op of these graphs changed meaning
  between opsets 21 and 23).
- OLMo 1 (`OlmoForCausalLM`): Hugging Face's OlmoLayerNorm is a LayerNorm without gain or bias,
  F.layer_norm(x, eps=1e-5) — mean-centred. onnxruntime-genai 0.18 writes it as RMSNorm (epsilon 1e-6),
  which is 0.9 x max|logit| away from Hugging Face on a tiny random OLMo. pagedkit rewrites those nodes:
  SimplifiedLayerNormalization -> LayerNormalization, com.microsoft SkipSimplifiedLayerNormalization ->
  SkipLayerNormalization (same inputs and output positions; the builder's gain is ones), epsilon 1e-5.
- the attention windows: the local_window_size of each GroupQueryAttention node must equal the window the
  config gives that layer (`layer_types` "sliding_attention" -> sliding_window; without `layer_types`, a
  `sliding_window` applies to every layer, as Hugging Face's Mistral / Phi-3 do). onnxruntime-genai 0.18
  writes -1 for Mistral and Phi-3, so such an export is refused with both lists (the native route keeps
  the window).
"""

from __future__ import annotations

import onnx
from onnx import helper

MS_DOMAIN = "com.microsoft"
RMS_OPSET = 23  # ai.onnx RMSNormalization
OLMO_EPS = 1e-5  # transformers' OlmoLayerNorm: F.layer_norm(..., eps=1e-5), not a config field


def _attr(node: onnx.NodeProto, name: str, default=None):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


def _set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    for o in model.opset_import:
        if o.domain == domain:
            o.version = max(o.version, version)
            return
    model.opset_import.append(helper.make_opsetid(domain, version))


def _retype(node: onnx.NodeProto, op_type: str, domain: str, attrs: dict) -> None:
    node.op_type, node.domain = op_type, domain
    del node.attribute[:]
    node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())


def olmo_layer_norms(model: onnx.ModelProto) -> int:
    """OLMo's norms as LayerNorm (module doc); returns how many nodes changed."""
    n = 0
    for node in model.graph.node:
        if node.op_type == "SimplifiedLayerNormalization" and node.domain in ("", "ai.onnx"):
            _retype(node, "LayerNormalization", "", {"axis": int(_attr(node, "axis", -1)), "epsilon": OLMO_EPS,
                                                     "stash_type": 1})
            n += 1
        elif node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == MS_DOMAIN:
            _retype(node, "SkipLayerNormalization", MS_DOMAIN, {"epsilon": OLMO_EPS})
            n += 1
    return n


def standard_rms_norms(model: onnx.ModelProto) -> int:
    """Default-domain SimplifiedLayerNormalization -> ONNX RMSNormalization (module doc); returns how many."""
    n = 0
    for node in model.graph.node:
        if node.op_type != "SimplifiedLayerNormalization" or node.domain not in ("", "ai.onnx"):
            continue
        if len([o for o in node.output if o]) > 1:
            raise NotImplementedError(f"{node.name}: SimplifiedLayerNormalization with its inv_std_var output used")
        _retype(node, "RMSNormalization", "", {"axis": int(_attr(node, "axis", -1)),
                                               "epsilon": float(_attr(node, "epsilon", 1e-5)),
                                               "stash_type": int(_attr(node, "stash_type", 1))})
        n += 1
    if n:
        _set_opset(model, "", RMS_OPSET)
    return n


def fix_builder_model(model: onnx.ModelProto, architecture: str) -> list[str]:
    """Apply the corrections of the module doc in place; returns what was done, in words."""
    done = []
    if architecture == "OlmoForCausalLM":
        n = olmo_layer_norms(model)
        if n:
            done.append(f"{n} OLMo norms RMSNorm -> LayerNorm without gain / bias, epsilon {OLMO_EPS} "
                        "(Hugging Face's OlmoLayerNorm)")
    n = standard_rms_norms(model)
    if n:
        done.append(f"{n} SimplifiedLayerNormalization -> ONNX RMSNormalization (opset {RMS_OPSET})")
    return done


def _effective(window, context: int | None) -> int:
    """A window that never binds within the context (>= max_position_embeddings) is full attention."""
    return int(window) if window and int(window) > 0 and (not context or int(window) < context) else -1


def expected_windows(config, num_layers: int) -> list[int]:
    """local_window_size per layer that a transformers config implies (-1: full attention, or a window of at
    least max_position_embeddings)."""
    window, context = getattr(config, "sliding_window", None), getattr(config, "max_position_embeddings", None)
    types = getattr(config, "layer_types", None)
    if types:
        return [_effective(window, context) if t == "sliding_attention" else -1 for t in types[:num_layers]]
    return [_effective(window, context)] * num_layers


def check_windows(model: onnx.ModelProto, config, architecture: str) -> None:
    """NotImplementedError when the builder's GroupQueryAttention windows differ from what the transformers
    `config` (layers cut as the export) gives."""
    got = [_effective(_attr(n, "local_window_size", -1), getattr(config, "max_position_embeddings", None))
           for n in model.graph.node if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    want = expected_windows(config, len(got))
    if got != want:
        raise NotImplementedError(
            f"--via genai: onnxruntime-genai's builder wrote local_window_size {got} for {architecture} where the "
            f"config (sliding_window {getattr(config, 'sliding_window', None)}, layer_types) gives {want}: the export would not "
            "attend as Hugging Face does; the native route keeps the window")


__all__ = ["check_windows", "expected_windows", "fix_builder_model", "olmo_layer_norms", "standard_rms_norms"]
