"""Our export vs onnxruntime-genai's builder (paged layout) on the same tiny checkpoint: the same graph
inputs / outputs (names, element types, ranks), the same genai_config.json decoder interface, and the same
logits through pagedkit's InferenceSession (both also against Hugging Face eager). Slow: the builder
takes ~10 s per model.

Mistral: onnxruntime-genai 0.18 exports Mistral without its sliding window (local_window_size -1 on
every node, since the config has no layer_types); with a window longer than the test sequences both
exports compute the same thing."""

from __future__ import annotations

import json

import pytest

from export_utils import (assert_close_logits, assert_valid_export, hf_greedy_sequence, io_signature,
                          run_tokens, save_tiny_checkpoint, tiny_model)

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=64)),
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", dict(sliding_window=64, original_max_position_embeddings=256)),
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": dict(rope_type="default",
                                                                                   rope_theta=10000.0),
                                                         "full_attention": dict(rope_type="default",
                                                                                rope_theta=1000000.0)})),
    "gpt_oss": ("GptOssConfig", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_same_interface_and_logits_as_genai_builder(family, tmp_path):
    from genai_models import BuilderFailed, run_builder

    from pagedkit.exporters.export import export

    cls, kw = FAMILIES[family]
    hf = tiny_model(cls, seed=31, **kw)
    ckpt = save_tiny_checkpoint(hf, tmp_path / "hf")
    try:
        theirs = run_builder(ckpt, tmp_path / "genai", "paged", tmp_path / "cache")
    except BuilderFailed as exc:
        pytest.skip(f"onnxruntime-genai builder failed on {family}: {exc}")
    ours = tmp_path / "ours"
    export(str(ckpt), ours)
    assert_valid_export(ours)
    assert io_signature(ours / "model.onnx") == io_signature(theirs / "model.onnx")
    cfg_o = json.loads((ours / "genai_config.json").read_text())["model"]["decoder"]
    cfg_t = json.loads((theirs / "genai_config.json").read_text())["model"]["decoder"]
    for key in ("inputs", "outputs", "state_groups", "num_attention_heads", "num_key_value_heads", "head_size",
                "hidden_size", "num_hidden_layers"):
        assert cfg_o[key] == cfg_t[key], key
    assert cfg_o.get("sliding_window", {}).get("layers") == cfg_t.get("sliding_window", {}).get("layers")
    lens = (11, 37)
    toks, refs = [], []
    for i, n in enumerate(lens):
        ids, ref = hf_greedy_sequence(hf, [3 + (7 * j + i) % 100 for j in range(n)], 4)
        toks.append(ids)
        refs.append(ref)
    chunk = 16 if "block_table_windowed" in io_signature(ours / "model.onnx") else None
    got_o = run_tokens(ours, toks, lens, chunk=chunk)
    got_t = run_tokens(theirs, toks, lens, chunk=chunk)
    print(family, "ours vs HF", assert_close_logits(got_o, refs, what="ours vs HF"),
          "genai vs HF", assert_close_logits(got_t, refs, what="genai vs HF"),
          "ours vs genai", assert_close_logits(got_o, got_t, what="ours vs genai"))
