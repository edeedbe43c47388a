"""The engine on a model with a sliding-window layer (tiny Gemma 2, window 16: layer 0 windowed, served from
a ring of blocks through `block_table_windowed`): prompts longer than the window, prefill chunks cut to
KVCacheManager.max_step_tokens, speculation and preemption, each request equal to the Generator alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkit.engine import Engine, SamplingParams
from pagedkit.runtime.generate import Generator
from test_engine import assert_pool_free, assert_same_greedy, check_stream, prompts_of, run_all


@pytest.fixture(scope="module")
def tiny_gemma2(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from export_utils import export_tiny, tiny_model

    out = tmp_path_factory.mktemp("engine-gemma2") / "onnx"
    export_tiny(tiny_model("Gemma2Config", sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                           query_pre_attn_scalar=16), out)
    return out


@pytest.fixture(scope="module")
def gemma_oracle(tiny_gemma2) -> Generator:
    return Generator(tiny_gemma2)


PROMPT_LENS = (5, 40, 70, 3)


@pytest.mark.parametrize("draft", [0, 3])
def test_windowed_batches_equal_alone(tiny_gemma2, gemma_oracle, draft):
    engine = Engine(tiny_gemma2, max_batch_size=3, max_num_tokens=24)
    assert engine.model.groups["windowed"].window == 16 and not engine.model.prefix_caching
    assert "sliding-window" in engine.model.prefix_caching_off_reason
    prompts = prompts_of(PROMPT_LENS, seed=30)
    sp = SamplingParams(max_new_tokens=20, ignore_eos=True, num_draft_tokens=draft)
    outs = run_all(engine, {0: [(p, sp) for p in prompts[:2]], 2: [(p, sp) for p in prompts[2:]]})
    for o, p in zip(outs.values(), prompts):
        assert_same_greedy(check_stream(o), gemma_oracle, p, 20, f"windowed, drafts {draft}", ignore_eos=True)
    if draft:
        assert engine.stats.draft_tokens > 0
    assert_pool_free(engine)


def test_windowed_preemption(tiny_gemma2, gemma_oracle):
    engine = Engine(tiny_gemma2, max_batch_size=3, max_num_tokens=24, num_blocks=6)
    prompts = prompts_of(PROMPT_LENS, seed=30)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert engine.stats.preemptions > 0
    for o, p in zip(outs, prompts):
        assert o.finish_reason == "length"
        assert_same_greedy(o.token_ids, gemma_oracle, p, 20, "windowed, preempted", ignore_eos=True)
    assert_pool_free(engine)


def test_windowed_rings_come_off_the_memory_before_the_full_pool(tiny_gemma2, monkeypatch):
    """The default full-attention pool is CPU_MEMORY_FRACTION of the available RAM left once the windowed rings
    (max_batch_size x ring_blocks blocks) are counted: hand arithmetic on the model's geometry."""
    import json
    import math

    from pagedkit.engine import model as model_module
    from pagedkit.engine.model import CPU_MEMORY_FRACTION

    dec = json.loads((tiny_gemma2 / "genai_config.json").read_text())["model"]["decoder"]
    per_layer_block = 2 * 16 * dec["num_key_value_heads"] * dec["head_size"] * 2  # fp16 K and V of 16 tokens
    ring_blocks = math.ceil((16 + 16 - 1) / 16) + 1  # window 16, chunks of one block: ceil((W + chunk - 1) / bs) + 1
    ring_bytes = 3 * ring_blocks * per_layer_block  # 3 sequences' rings of the one windowed layer
    ram = ring_bytes + int(20.5 * per_layer_block / CPU_MEMORY_FRACTION)  # 20.5 full blocks' worth after the rings
    monkeypatch.setattr(model_module, "available_ram", lambda: ram)
    engine = Engine(tiny_gemma2, max_batch_size=3, max_num_tokens=24)
    windowed, full = engine.model.groups["windowed"], engine.model.groups["full"]
    assert engine.model.block_size == 16 and windowed.ring_blocks == ring_blocks
    assert windowed.num_blocks == 3 * ring_blocks and len(full.layers) == len(windowed.layers) == 1
    assert full.num_blocks == 20, engine.model.pool_summary()
