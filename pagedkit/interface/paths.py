"""Containment of the paths a model folder names: a file named by genai_config.json (or a fixed name such
as model.onnx / tokenizer.json) is opened only when it resolves inside the folder, symlinks included.

The rule is the one of the external-data check (validators/model_loading.py): a relative path without
'..', resolving (after symlinks) inside the resolved model folder. Nothing is opened to decide: only
`Path.resolve` (lstat / readlink). Torch-free; imports nothing else of pagedkit.

    path = inside_folder(folder, cfg["model"]["decoder"]["filename"], "model.decoder.filename")
    check_config_paths(cfg, folder)      # every file the config names (any "...filename" / "..._file" key)
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

from .. import settings

__all__ = ["UnsafePathError", "config_paths", "check_config_paths", "inside_folder", "model_cache_root",
           "path_problem", "recorded_checkpoint"]

CONFIG_NAME = "genai_config.json"
# keys whose string value (or list of strings) is a file of the model folder
_PATH_KEY = re.compile(r"(^|_)(filename|filenames|file|files|path|paths|library)$")


class UnsafePathError(ValueError):
    """A path named by a model folder (its config, or a fixed file name) is not a file inside the folder."""


def path_problem(folder: str | os.PathLike, name: Any) -> str | None:
    """Why `name` is not a relative path resolving inside `folder` (None: it is). Opens nothing."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if not name or "\x00" in name:
        return "is not a file name"
    p = Path(name)
    if p.is_absolute() or re.match(r"^[A-Za-z]:|^[\\/]", name) or ".." in p.parts or ".." in name.split("\\"):
        return "resolves outside the model folder"
    try:
        base = Path(folder).resolve()
        target = (base / p).resolve()
    except (OSError, RuntimeError, ValueError):  # symlink loop, name too long, ...
        return "cannot be resolved inside the model folder"
    if target == base:
        return "names the model folder itself, not a file in it"
    if base not in target.parents:
        return "resolves outside the model folder"
    return None


def inside_folder(folder: str | os.PathLike, name: Any, field: str | None = None, source: str = CONFIG_NAME) -> Path:
    """folder / name, after checking that it resolves inside folder; raises UnsafePathError otherwise,
    naming `field` (e.g. "model.decoder.filename") and `source` (the file that named it), or, for a fixed
    file name (field None: model.onnx, genai_config.json, tokenizer.json), the path itself."""
    problem = path_problem(folder, name)
    if problem:
        if field is None:
            raise UnsafePathError(f"{Path(folder) / str(name)}: {problem} (a symlink?)")
        raise UnsafePathError(f"{source}: {field} {name!r} {problem}")
    return Path(folder) / name


def config_paths(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field, value) for every file a genai_config names: the values of keys like "filename",
    "config_filename", "adapter_file", "custom_ops_library", "..._path" at any depth (lists of names included)."""
    if isinstance(config, Mapping):
        for key, value in config.items():
            field = f"{prefix}.{key}" if prefix else str(key)
            pathy = isinstance(key, str) and _PATH_KEY.search(key.lower())
            if pathy and (isinstance(value, str) or (key == "filename" and value is not None)):
                yield field, value  # "filename" is opened: any non-string there is refused too
            elif pathy and isinstance(value, list):  # "adapter_filenames": [...]
                for i, v in enumerate(value):
                    if isinstance(v, str):
                        yield f"{field}[{i}]", v
                    else:
                        yield from config_paths(v, f"{field}[{i}]")
            else:
                yield from config_paths(value, field)
    elif isinstance(config, list):
        for i, value in enumerate(config):
            yield from config_paths(value, f"{prefix}[{i}]")


def check_config_paths(config: Any, folder: str | os.PathLike, source: str = CONFIG_NAME) -> None:
    """Raise UnsafePathError for the first file named by `config` that is not inside `folder`."""
    for field, value in config_paths(config):
        inside_folder(folder, value, field, source)


def model_cache_root() -> Path:
    """pagedkit's model cache ($PAGEDKIT_CACHE, default ~/.cache/pagedkit): where `paged-fetch` puts
    models. The user's environment names it, never a model folder's config."""
    return settings.read("PAGEDKIT_CACHE")


def recorded_checkpoint(folder: str | os.PathLike, name: Any, field: str = "pagedkit.source.checkpoint") -> Path:
    """The source checkpoint a model folder's config records (for `paged-run --parity` without a path),
    allowed only inside the model folder or inside pagedkit's model cache (what `paged-fetch` wrote):
    a config cannot make pagedkit open an arbitrary file. Raises UnsafePathError naming the field
    otherwise. Opens nothing."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise UnsafePathError(f"{CONFIG_NAME}: {field} {name!r} is not a path")
    if path_problem(folder, name) is None:
        return Path(folder) / name
    try:
        root = model_cache_root().resolve()
        target = Path(name).expanduser().resolve() if Path(name).is_absolute() else None
    except (OSError, RuntimeError, ValueError):
        target = None
    if target is not None and root in target.parents:
        return target
    raise UnsafePathError(f"{CONFIG_NAME}: {field} {name!r} is outside the model folder and pagedkit's model "
                          f"cache ({model_cache_root()}); pass it explicitly (--parity PATH) to compare with it")
