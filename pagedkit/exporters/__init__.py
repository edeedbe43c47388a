"""pagedkit.exporters: Hugging Face causal LMs -> PagedAttention ONNX graphs (`paged-export`, docs/export.md).

Public API (imported lazily; the genai_config writer the rewriters reuse is pagedkit.interface, free of
torch; `pagedkit.exporters.config` re-exports it):
    export(name_or_path, out_dir, opts, num_layers=..., ...)   load + export + validate -> ExportResult
    export_hf_model(hf_model, out_dir, opts, ...)              an in-memory transformers model
    build_model(hf_model, opts) -> (onnx.ModelProto, ModelSpec)
    ExportOptions, KVOptions                                   export / KV-cache options
    ModelSpec, LayerSpec, CacheSpec, write_genai_config, read_pagedkit_section   (pagedkit.interface)
"""

_LAZY = {
    "export": "export", "export_hf_model": "export", "build_model": "export", "ExportResult": "export",
    "ExportError": "export", "ExportOptions": "families.base", "KVOptions": "families.base",
    "ModelSpec": "..interface", "LayerSpec": "..interface", "CacheSpec": "..interface",
    "write_genai_config": "..interface", "read_pagedkit_section": "..interface", "family_for": "registry",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        mod = _LAZY[name]
        return getattr(importlib.import_module(mod if mod.startswith(".") else f".{mod}", __name__), name)
    raise AttributeError(f"module 'pagedkit.exporters' has no attribute {name!r}")
