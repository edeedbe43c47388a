"""examples/serve_exported_model.py on a tiny exported Llama with a word-level tokenizer: every concurrent request
completes, the requests share batches, and each answer equals the same request sent alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

from export_utils import export_tiny, tiny_model  # noqa: E402
from test_serve_helpers import write_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _example():
    spec = importlib.util.spec_from_file_location("serve_exported_model", ROOT / "examples" / "serve_exported_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_example_serves_concurrent_prompts(tmp_path, capsys):
    export_tiny(tiny_model("LlamaConfig"), tmp_path / "tiny")
    model_dir = write_tokenizer(tmp_path / "tiny")
    ex = _example()
    summary = ex.serve_and_ask(model_dir, prompts=4, max_tokens=16)
    out = capsys.readouterr().out
    assert summary["prompts"] == 4 and summary["completion_tokens"] > 0 and summary["tokens_per_s"] > 0
    assert summary["max_batch"] > 1, "the concurrent requests never shared a step"
    assert out.count("] '") == 4 and "concurrent requests" in out
    in_batch = [line for line in out.splitlines() if line.startswith("[0]")]
    ex.serve_and_ask(model_dir, prompts=1, max_tokens=16)  # request 0 alone: the same greedy answer
    alone = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[0]")]
    assert in_batch == alone and len(alone) == 1
