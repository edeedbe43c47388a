"""What `paged-export --via genai` (via_genai.py) serves, as data: the builder architectures it serves
(SERVED, with their Hugging Face model_type), those it refuses with a specific reason (NOT_SERVED), the
architectures the installed onnxruntime-genai builder knows, and the reason for any other one (`refusal`).

Below via_genai.py (which imports these names, so `via_genai.SERVED` etc. still name them) and registry.py
(whose `family_for` names the model_types the route serves when no native family does).
"""

from __future__ import annotations

import re
from pathlib import Path

# builder architecture -> Hugging Face model_type, for the architectures this route serves (each one has a
# parity test against Hugging Face eager in tests/test_export_via_genai.py)
SERVED = {
    "Ernie4_5ForCausalLM": "ernie4_5", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
    "GptOssForCausalLM": "gpt_oss", "GraniteForCausalLM": "granite", "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral", "NemotronForCausalLM": "nemotron", "OlmoForCausalLM": "olmo",
    "PhiForCausalLM": "phi", "Phi3ForCausalLM": "phi3", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "SmolLM3ForCausalLM": "smollm3",
}
# builder architectures refused with a specific reason (measured with onnxruntime-genai 0.18, transformers 5.25)
_CONV = "holds a convolution state besides its attention caches (LFM2 short-conv layers); PagedAttention " \
        "models hold attention caches only"
NOT_SERVED = {
    "Lfm2ForCausalLM": _CONV, "Lfm2MoeForCausalLM": _CONV, "Lfm2VlForConditionalGeneration": _CONV,
    "Lfm2AudioForConditionalGeneration": _CONV,
    "GraniteMoeHybridForCausalLM": "hybrid model: its Mamba-2 layers hold a recurrent state, not an attention cache",
    "Qwen3_5ForConditionalGeneration": "hybrid linear-attention model: its Gated DeltaNet layers hold a "
                                       "recurrent state, not an attention cache",
    "Qwen3_5MoeForConditionalGeneration": "hybrid linear-attention model: its Gated DeltaNet layers hold a "
                                          "recurrent state, not an attention cache",
    "WhisperForConditionalGeneration": "encoder-decoder model (cross-attention); the route serves decoder-only LMs",
    "PhiMoEForCausalLM": "the builder exports PhiMoE for CUDA int4 only (QMoE), not a float GQA model to rewrite",
    "Gemma3ForCausalLM": "onnxruntime-genai 0.18's builder fails on transformers 5 Gemma 3 configs "
                         "(KeyError: 'rope_type')",
    "HunYuanDenseV1ForCausalLM": "the builder's HunYuan model takes a position_ids input (RoPE outside "
                                 "GroupQueryAttention), which the paged rewrite refuses",
}


def served_model_types() -> list[str]:
    return sorted(set(SERVED.values()))


def builder_architectures() -> list[str]:
    """The architectures the installed builder dispatches on (`config.architectures[0] == "..."` in its
    builder.py, read as text: importing it loads torch and the builder's own modules); [] without it."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("onnxruntime_genai")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / "builder.py"
    if not path.is_file():
        return []
    return sorted(set(re.findall(r'config\.architectures\[0\] == "(\w+)"', path.read_text(encoding="utf-8"))))


def refusal(architecture: str) -> str | None:
    """Why the route does not serve this builder architecture (None: served)."""
    if architecture in SERVED:
        return None
    if architecture in NOT_SERVED:
        return NOT_SERVED[architecture]
    if architecture not in set(builder_architectures()):
        return "not an architecture onnxruntime-genai's builder knows"
    import transformers

    try:
        getattr(transformers, architecture)
    except (AttributeError, ImportError):
        return "not a transformers architecture: loading it needs trust_remote_code, which pagedkit never uses"
    if not architecture.endswith("ForCausalLM"):
        return "multimodal or encoder-decoder checkpoint: the route serves text-only *ForCausalLM checkpoints"
    return "not yet checked against Hugging Face by pagedkit's tests (tests/test_export_via_genai.py)"
