"""The engine's KV pool sizing: bytes per block against an independent count, the free-memory rule (a fraction of
what the device has free, capped at max_batch_size x context) and the default pool sized that way: on the CPU
from the available RAM (issue 37: it was max_batch_size x context whatever the machine had), on CUDA from the
free GPU memory."""

from __future__ import annotations

import json

import pytest
import torch

from pagedkit.engine import Engine
from pagedkit.engine import model as model_module
from pagedkit.engine.model import CPU_MEMORY_FRACTION, GPU_MEMORY_FRACTION, block_bytes, pool_blocks


def _geometry(model_dir):
    dec = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    return dec["num_hidden_layers"], dec["num_key_value_heads"], dec["head_size"]


def test_block_bytes_counts_k_and_v_of_every_layer(tiny_llama):
    engine = Engine(tiny_llama, max_batch_size=2, max_num_tokens=32)
    group = engine.kv.config.group("full")
    layers, hkv, d = _geometry(tiny_llama)
    assert block_bytes(group.layers, group.block_size) == layers * 2 * group.block_size * hkv * d * 2  # fp16 K, V
    assert engine.model.pool_sizing == f"available RAM x {CPU_MEMORY_FRACTION} (capped at max_batch_size x context)"


def test_cpu_default_pool_is_a_fraction_of_the_available_ram(tiny_llama, monkeypatch):
    layers, hkv, d = _geometry(tiny_llama)
    per_block = layers * 2 * 16 * hkv * d * 2  # fp16 K and V of 16 tokens, every layer (the model's block size)
    ram = {"bytes": int(10.5 * per_block / CPU_MEMORY_FRACTION)}
    monkeypatch.setattr(model_module, "available_ram", lambda: ram["bytes"])
    engine = Engine(tiny_llama, max_batch_size=4, max_num_tokens=32)
    group = engine.kv.config.group("full")
    assert group.block_size == 16 and engine.num_blocks() == {"full": 10}  # 10.5 blocks' worth: 10
    assert engine.max_pool_tokens == 160 and "160 tokens" in engine.model.pool_summary()
    assert "available RAM x 0.25" in engine.model.pool_summary()
    assert Engine(tiny_llama, max_batch_size=4, max_num_tokens=32, memory_fraction=0.5).num_blocks() == {"full": 21}
    ram["bytes"] = 10 ** 15  # plenty: every batch slot can reach the context length, no more
    cap = 4 * -(-engine.max_seq_len // 16)
    assert Engine(tiny_llama, max_batch_size=4, max_num_tokens=32).num_blocks() == {"full": cap}
    ram["bytes"] = None  # unknown: the batch rule alone
    unknown = Engine(tiny_llama, max_batch_size=4, max_num_tokens=32)
    assert unknown.num_blocks() == {"full": cap} and unknown.model.pool_sizing == "max_batch_size x context"
    assert Engine(tiny_llama, max_batch_size=4, max_num_tokens=32, num_blocks=7).num_blocks() == {"full": 7}
    with pytest.raises(ValueError, match="memory_fraction"):
        Engine(tiny_llama, max_batch_size=4, max_num_tokens=32, memory_fraction=1.5)


def test_available_ram_is_memavailable():
    import psutil  # an independent reader of the same figure (the test extra)
    got, ref = model_module.available_ram(), psutil.virtual_memory().available
    assert got is not None and abs(got - ref) <= 0.1 * ref


def test_pool_blocks_rule():
    assert pool_blocks(10_000, 0.5, 1_000, cap=100) == 5
    assert pool_blocks(10_000, 1.0, 1_000, cap=3) == 3  # never more than the batch can use
    assert pool_blocks(10, 0.9, 1_000, cap=8) == 1  # at least one block
    with pytest.raises(ValueError, match="memory_fraction"):
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
