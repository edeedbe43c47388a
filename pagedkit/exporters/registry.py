"""Hugging Face `model_type` -> exporter family (one module per family under `families/`)."""

from __future__ import annotations

import importlib

from .families.base import DecoderFamily

# model_type -> "module:Class" (imported on use)
FAMILIES: dict[str, str] = {
    "llama": "llama:LlamaFamily",
    "mistral": "mistral:MistralFamily",
    "qwen3": "qwen3:Qwen3Family",
    "phi3": "phi3:Phi3Family",
    "gemma2": "gemma2:Gemma2Family",
    "gemma3_text": "gemma3:Gemma3Family",
    "gpt_oss": "gpt_oss:GptOssFamily",
    "deepseek_v2": "deepseek:DeepseekFamily", "deepseek_v3": "deepseek:DeepseekFamily",
}


def family_for(config_or_model_type) -> DecoderFamily:
    """The family exporting this config (or model_type); NotImplementedError naming the supported ones."""
    model_type = config_or_model_type if isinstance(config_or_model_type, str) else config_or_model_type.model_type
    spec = FAMILIES.get(model_type)
    if spec is None:
        raise NotImplementedError(f"model_type {model_type!r} has no pagedkit exporter; supported: "
                                  f"{', '.join(sorted(FAMILIES))}")
    module, cls = spec.split(":")
    return getattr(importlib.import_module(f".families.{module}", __package__), cls)()


def supported() -> dict[str, tuple[str, ...]]:
    """model_type -> the family's declared features."""
    return {mt: family_for(mt).features for mt in sorted(FAMILIES)}
