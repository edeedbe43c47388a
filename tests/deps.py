"""The third-party modules the test suite needs, each with the requirement that installs it (pyproject's `test`,
`export` and `triton-cpu` extras, and onnxruntime-genai: the README's test command).

`python tests/deps.py` imports every one and exits 1 naming each that cannot be imported; .ci/run runs it
after installing, before the tests. Under CI (CI=true), tests/conftest.py turns a skip caused by a missing
module (`pytest.importorskip`, or a skip reason naming one of these as needed) into a failure, so a missing
dependency can never pass CI as "N skipped". tests/test_ci_strict.py checks that every third-party module a
file under tests/ imports is listed here.
"""

from __future__ import annotations

import importlib
import os
import re
import sys

REQUIRED = {  # module: what installs it
    "numpy": "numpy", "onnx": "onnx", "onnx_ir": "onnx-ir", "torch": "torch==2.13.0",
    "ml_dtypes": "ml_dtypes (onnx's dependency)",
    "pytest": "pytest ([test])", "hypothesis": "hypothesis ([test])", "onnxruntime": "onnxruntime==1.32.0 ([test])",
    "starlette": "starlette ([test])", "uvicorn": "uvicorn ([test])", "httpx": "httpx ([test])",
    "tqdm": "tqdm ([test])", "matplotlib": "matplotlib ([test])", "openai": "openai ([test])",
    "prometheus_client": "prometheus_client ([test])", "jsonschema": "jsonschema ([test])",
    "psutil": "psutil ([test])", "llguidance": "llguidance ([test])",
    "transformers": "transformers ([export])", "tokenizers": "tokenizers (transformers' dependency)",
    "safetensors": "safetensors ([export])", "gguf": "gguf ([export])", "accelerate": "accelerate ([export])",
    "triton": "triton==3.8.0 ([triton-cpu])",
    "onnxruntime_genai": "onnxruntime-genai",
}

# A skip reason that says a needed module is missing: pytest.importorskip's own wording, or "needs triton" /
# "no onnxruntime_genai" style reasons naming a module above (not "needs onnxruntime-gpu", not "needs CUDA").
_NAMES = "|".join(sorted((re.escape(m) for m in REQUIRED), key=len, reverse=True))
MISSING_MODULE_REASON = re.compile(
    rf"could not import '|module '[\w.]+' has __version__|\b(?:needs?|requires?|no|without)\s+(?:{_NAMES})(?![\w-])",
    re.IGNORECASE)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing() -> list[tuple[str, str, str]]:
    """(module, what installs it, the import error) for each module of REQUIRED that cannot be imported."""
    out = []
    for mod, req in REQUIRED.items():
        try:
            importlib.import_module(mod)
        except Exception as exc:  # noqa: BLE001 - an install broken in any way is missing
            out.append((mod, req, f"{type(exc).__name__}: {exc}"))
    return out


def main() -> int:
    gone = missing()
    for mod, req, err in gone:
        print(f"MISSING test dependency: `import {mod}` fails ({err}); install {req}", file=sys.stderr)
    if gone:
        print(f"{len(gone)} test dependencies missing: {', '.join(m for m, _, _ in gone)}", file=sys.stderr)
        return 1
    print(f"test dependencies: all {len(REQUIRED)} import")
    return 0


if __name__ == "__main__":
    sys.exit(main())
