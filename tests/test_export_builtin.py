"""Built-in configs at their real dimensions (layers cut), random weights: the docs/export.md example end to
end, and one exported layer of every built-in whose family exists, validated and run for one prefill.
Slow (1-3 minutes and up to ~7 GiB of memory each)."""

from __future__ import annotations

import numpy as np
import pytest

from export_utils import assert_valid_export

BUILTINS = {  # name -> extra paged-export flags
    "llama-3.1-8b": [], "mistral-7b": [], "qwen3-8b": [], "phi-3-mini": [], "gemma-2-9b": [],
    "gemma-3-4b": [], "gpt-oss-20b": ["--num-experts", "4"],
}


def _prefill(model_dir, tokens: int = 6) -> np.ndarray:
    import pagedkit

    sess = pagedkit.InferenceSession(str(model_dir / "model.onnx"))
    names = {i.name for i in sess.get_inputs()}
    ids = np.arange(100, 100 + tokens, dtype=np.int64)
    feeds = {"input_ids": ids, "block_table": np.array([[5, 2]], dtype=np.int32),
             "cumulative_sequence_lengths": np.array([0, tokens], dtype=np.int32),
             "past_sequence_lengths": np.array([0], dtype=np.int32),
             "attention_metadata": np.array([tokens, tokens, 0], dtype=np.int32)}
    if "block_table_windowed" in names:
        feeds["block_table_windowed"] = np.array([[1, 3]], dtype=np.int32)
    for inp in sess.get_inputs():
        if inp.name.startswith("past_key_values."):
            feeds[inp.name] = np.zeros((8, 16, *inp.shape[2:]), dtype=np.float16)
    out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    return out["logits"]


@pytest.mark.slow
def test_docs_example(tmp_path, capsys):
    """paged-export --model llama-3.1-8b --num-layers 2 --output DIR, then one prefill (docs/export.md)."""
    from pagedkit.exporters.cli import main

    assert main(["--model", "llama-3.1-8b", "--num-layers", "2", "--output", str(tmp_path), "--quiet"]) == 0
    assert "parameters:           1,486,901,248" in capsys.readouterr().out
    assert_valid_export(tmp_path)
    logits = _prefill(tmp_path)
    assert logits.shape == (6, 128256) and np.isfinite(logits).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in BUILTINS if n != "llama-3.1-8b"])
def test_builtin_one_layer(name, tmp_path):
    from pagedkit.exporters.cli import main

    assert main(["--model", name, "--num-layers", "1", "--output", str(tmp_path), "--quiet", *BUILTINS[name]]) == 0
    assert_valid_export(tmp_path)
    logits = _prefill(tmp_path)
    assert np.isfinite(logits).all()
