"""The engine's KV pool sizing: bytes per block against an independent count, the free-memory rule (a fraction of
what the GPU has free, capped at max_batch_size x context) and, on CUDA, the default pool sized that way."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkit.engine import Engine
from pagedkit.engine.model import GPU_MEMORY_FRACTION, block_bytes, pool_blocks


def _geometry(model_dir):
    dec = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    return dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]


def test_block_bytes_counts_k_and_v_of_every_layer(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=2, max_num_tokens=32)
    group = engine.kv.config.group("full")
    layers, hkv, d = _geometry(tiny_llama)
    assert block_bytes(group.layers, group.block_size) == layers * 2 * group.block_size * hkv * d * 2  # fp16 K, V
    assert engine.model.pool_sizing == "max_batch_size x context"  # CPU: the batch rule


def test_pool_blocks_rule():
    assert pool_blocks(10_000, 0.5, 1_000, cap=100) == 5
    assert pool_blocks(10_000, 1.0, 1_000, cap=3) == 3  # never more than the batch can use
    assert pool_blocks(10, 0.9, 1_000, cap=8) == 1  # at least one block
    with pytest.raises(ValueError, match="gpu_memory_fraction"):
        pool_blocks(10_000, 1.5, 1_000, cap=8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_pool_fits_the_free_memory(tiny_llama):
    engine = Engine(tiny_llama, device="cuda", max_batch_size=4, max_num_tokens=64)
    group = engine.kv.config.group("full")
    free, _ = torch.cuda.mem_get_info()
    assert "free GPU memory" in engine.model.pool_sizing
    assert group.num_blocks * block_bytes(group.layers, group.block_size) <= free / GPU_MEMORY_FRACTION
    out = engine.generate([[3, 9, 4]], None)[0]
    assert out.finished and out.token_ids
