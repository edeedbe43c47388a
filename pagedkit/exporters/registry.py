"""Hugging Face `model_type` -> exporter family (one module per family under `families/`).

Families are discovered: every module of `families/` whose classes subclass `DecoderFamily` and declare
`model_types` registers them (a new family is one new file, nothing else to edit). A `model_type` claimed by
two families is an error at discovery.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from .families.base import DecoderFamily

_SKIP = {"base", "__init__"}  # modules of families/ that hold shared code, not families


@lru_cache(maxsize=1)
def _families() -> dict[str, type[DecoderFamily]]:
    """model_type -> family class, from every module of families/."""
    from . import families

    found: dict[str, type[DecoderFamily]] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda m: m.name):
        if info.name in _SKIP or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{families.__name__}.{info.name}")
        for obj in vars(module).values():
            if not (isinstance(obj, type) and issubclass(obj, DecoderFamily) and obj.__module__ == module.__name__):
                continue
            for mt in obj.__dict__.get("model_types", ()):  # declared by the class itself, not inherited
                if mt in found and found[mt] is not obj:
                    raise RuntimeError(f"model_type {mt!r} is claimed by {found[mt].__name__} and {obj.__name__}")
                found[mt] = obj
    return found


def families() -> dict[str, type[DecoderFamily]]:
    """model_type -> family class (a copy)."""
    return dict(_families())


def family_for(config_or_model_type) -> DecoderFamily:
    """The family exporting this config (or model_type); NotImplementedError naming the supported ones."""
    model_type = config_or_model_type if isinstance(config_or_model_type, str) else config_or_model_type.model_type
    cls = _families().get(model_type)
    if cls is None:
        from .genai_served import served_model_types

        via = served_model_types()
        what = ("use `paged-export --via genai`" if model_type in via else f"{model_type!r} is in neither")
        raise NotImplementedError(f"model_type {model_type!r} has no native pagedkit exporter; native: "
                                  f"{', '.join(sorted(_families()))}; `--via genai` (onnxruntime-genai's builder, "
                                  f"then the paged rewrite): {', '.join(via)}; {what} "
                                  "(`paged-export --list` shows both routes)")
    return cls()


def supported() -> dict[str, tuple[str, ...]]:
    """model_type -> the family's declared features."""
    return {mt: cls.features for mt, cls in sorted(_families().items())}
