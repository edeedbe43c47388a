"""The planning table of docs/distributed.md (pagedkit/exporters/tp/comm.py): its exact columns against
arithmetic done here by hand (Llama-3.1-8B's config) and against what `paged-export --tp 2` really writes (a
tiny model's rank files), and the committed table equal to what the module computes now."""

from __future__ import annotations

import onnx
import pytest

import tp_harness as H

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_llama_8b_by_hand():
    from pagedkit.exporters.tp import comm

    (name, _, t, cuts), = comm.rows(["llama-3.1-8b"])
    h, inter, layers, vocab, kv, d = 4096, 14336, 32, 128256, 8, 128  # 32 query heads of 128: q and o are h x h
    assert (t.all_reduces(1), t.all_reduces(2), t.all_reduces(8)) == (0, 2 * layers, 2 * layers)
    assert t.reduce_bytes_per_token(4) == 2 * layers * h * 2
    assert t.gather_bytes_per_token(2) == vocab * 2 and t.gather_bytes_per_token(8) == 8 * -(-vocab // 8) * 2
    for n, c in zip(comm.WORLDS, cuts):
        per_layer = (h * h + 2 * kv * d * h + h * h + 3 * inter * h) // n + 2 * h  # q k v o gate up down / n, norms
        params = vocab * h + (vocab // n) * h + layers * per_layer + h  # embedding whole, its LM head rows
        assert c.weights == 2 * params, (n, c.weights, 2 * params)
        assert c.kv_per_token == layers * (kv // n) * d * 2 * 2
    assert [c.refused for c in cuts] == [None] * 4


def test_prediction_is_what_the_export_writes(tmp_path):
    """Rank 0's parameter bytes as predicted == the bytes of the initializers rank 0's fp16 graph holds (every
    one but the rotary tables and the small constants), here with one KV head replicated, a padded vocabulary and a
    tied LM head (the rank's rows of the replicated table)."""
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp import comm
    from pagedkit.exporters.tp.export import export_tp_model

    hf = H.Case("Qwen2Config", (("num_key_value_heads", 1), ("vocab_size", 145), ("tie_word_embeddings", True)),
                seed=3).model()
    export_tp_model(hf, tmp_path, ExportOptions(dtype="fp16", progress=False), tp=2)
    m = onnx.load(str(tmp_path / "rank_0" / "model.onnx"))
    written = sum(len(t.raw_data) for t in m.graph.initializer
                  if not any(k in t.name for k in ("cos_cache", "sin_cache", "/model/constants/")))
    predicted = comm.cut(comm.meta_model(hf.config), 2)
    assert predicted.weights == written
    assert predicted.kv_per_token == 2 * 1 * 16 * 2 * 2  # 2 layers x its one KV head x 16 x K and V x fp16


def test_committed_table_is_current():
    from pagedkit.exporters.tp import comm

    assert comm.main(["--check"]) == 0, "docs/distributed.md's table is stale: python -m pagedkit.exporters.tp.comm " \
                                        "--write-doc"
