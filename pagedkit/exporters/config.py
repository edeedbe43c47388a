"""Moved to the ground floor: the genai_config.json writer / reader and ModelSpec / LayerSpec / CacheSpec
live in pagedkit/interface/genai_config.py, the cache-name templates in pagedkit/interface/names.py.
This module only re-exports them for existing imports (`pagedkit.exporters.config.read_pagedkit_section`)."""

from ..interface.genai_config import (  # noqa: F401
    PAGEDKIT_CONFIG_VERSION, PAGEDKIT_KEY, CacheSpec, LayerSpec, ModelSpec, genai_config, genai_type_of,
    pagedkit_section, read_genai_config, read_pagedkit_section, with_decoded_pagedkit, write_genai_config,
)
from ..interface.names import (  # noqa: F401
    PAST_KEY, PAST_KEY_SCALE, PAST_VALUE, PAST_VALUE_SCALE, PRESENT_KEY, PRESENT_KEY_SCALE, PRESENT_VALUE,
    PRESENT_VALUE_SCALE,
)
