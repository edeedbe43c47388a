"""Test-session setup. Without CUDA the Triton kernels run through Triton's interpreter: TRITON_INTERPRET=1 is
set here, before any test imports a kernel module (triton reads it when a kernel is decorated)."""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (tests/export_utils.TINY) exported once per session; tests only read the folder."""
    pytest.importorskip("transformers")
    from export_utils import export_tiny, tiny_model

    out = tmp_path_factory.mktemp("tiny-llama") / "onnx"
    export_tiny(tiny_model("LlamaConfig"), out)
    return out


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
