"""pagedkit.interface: the ground floor — the model-level I/O convention every other layer shares.

Imports nothing else of pagedkit and never torch (torch dtypes come from functions that import it):
    names         onnxruntime-genai's graph input / output names and the '%d' cache-name templates
                  (past_key_values.%d.key -> present.%d.key, ...; layer_name, layer_of, past_name)
    genai_config  ModelSpec / LayerSpec / CacheSpec, genai_config.json writing and reading, the
                  "pagedkit" section (write_genai_config, read_genai_config, read_pagedkit_section,
                  cache_templates)
    dtypes        ONNX element type <-> "tensor(float16)" <-> torch dtype <-> numpy dtype
    paths         containment of the paths a model folder's config names (inside_folder, check_config_paths)
"""

from . import dtypes, names
from .genai_config import (
    CacheSpec, LayerSpec, ModelSpec, cache_templates, genai_config, read_genai_config, read_pagedkit_section,
    with_decoded_pagedkit, write_genai_config,
)

__all__ = ["CacheSpec", "LayerSpec", "ModelSpec", "cache_templates", "dtypes", "genai_config", "names",
           "read_genai_config", "read_pagedkit_section", "with_decoded_pagedkit", "write_genai_config"]
