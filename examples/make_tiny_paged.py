"""Write examples/tiny-paged/: a tiny random fp16 decoder in onnxruntime-genai's paged layout.

    python examples/make_tiny_paged.py [OUT_DIR]      # default: examples/tiny-paged next to this file
    paged-validate examples/tiny-paged                # -> OK: 2 attention nodes checked

Model (hidden 64, 2 layers, 4 query heads / 2 KV heads of size 16, block size 16, vocab 128; random
weights, seeded, so the output is byte-for-byte reproducible):

    input_ids [num_tokens] int64 -> Gather(embedding [128, 64])                           h [T, 64]
    per layer i:  RMSNormalization -> MatMul [64, 128] -> packed QKV [T, (4 + 2*2) * 16]
                  PagedAttention(do_rotary=1, cos/sin initializers [128, 8]) over
                  past_key_values.{i}.key/value [num_blocks, 16, 2, 16] -> present.{i}.key/value
                  -> MatMul [64, 64] -> Add (residual)
    RMSNormalization -> MatMul [64, 128] -> logits [num_tokens, 128] fp16

Graph inputs as onnxruntime-genai's builder names them: cumulative_sequence_lengths [batch_size + 1],
past_sequence_lengths [batch_size], block_table [batch_size, max_num_blocks], attention_metadata [3]
(all int32). genai_config.json names the inputs and the cache pairs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pagedkit.validators.builders import make_paged_attention_node

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_SIZE = 64, 2, 4, 2, 16
BLOCK_SIZE, VOCAB, MAX_POS, ROPE_THETA, EPS = 16, 128, 128, 10000.0, 1e-6
FP16 = TensorProto.FLOAT16


def _weight(rng: np.random.Generator, name: str, shape: tuple[int, ...], std: float) -> TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * std).astype(np.float16), name)


def _rope_tables() -> tuple[TensorProto, TensorProto]:
    """cos_cache / sin_cache [MAX_POS, HEAD_SIZE / 2] (half / GPT-NeoX rotary over the whole head)."""
    inv_freq = 1.0 / ROPE_THETA ** (np.arange(0, HEAD_SIZE, 2, dtype=np.float64) / HEAD_SIZE)
    angles = np.outer(np.arange(MAX_POS, dtype=np.float64), inv_freq)  # [MAX_POS, HEAD_SIZE / 2]
    return (numpy_helper.from_array(np.cos(angles).astype(np.float16), "cos_cache"),
            numpy_helper.from_array(np.sin(angles).astype(np.float16), "sin_cache"))


def build_model(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    cache_shape = ["num_blocks", BLOCK_SIZE, KV_HEADS, HEAD_SIZE]  # [NB, BS, Hkv, D]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["num_tokens"]),
        helper.make_tensor_value_info("cumulative_sequence_lengths", TensorProto.INT32, ["batch_size + 1"]),
        helper.make_tensor_value_info("past_sequence_lengths", TensorProto.INT32, ["batch_size"]),
        helper.make_tensor_value_info("block_table", TensorProto.INT32, ["batch_size", "max_num_blocks"]),
        helper.make_tensor_value_info("attention_metadata", TensorProto.INT32, [3]),
    ]
    outputs = [helper.make_tensor_value_info("logits", FP16, ["num_tokens", VOCAB])]
    inits = [_weight(rng, "embed_tokens.weight", (VOCAB, HIDDEN), 1.0), *_rope_tables()]
    nodes = [helper.make_node("Gather", ["embed_tokens.weight", "input_ids"], ["h0"], name="embed")]
    qkv_width = (HEADS + 2 * KV_HEADS) * HEAD_SIZE
    h = "h0"
    for i in range(LAYERS):
        p = f"layers.{i}"
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        present_k, present_v = f"present.{i}.key", f"present.{i}.value"
        inputs += [helper.make_tensor_value_info(n, FP16, cache_shape) for n in (past_k, past_v)]
        outputs += [helper.make_tensor_value_info(n, FP16, cache_shape) for n in (present_k, present_v)]
        inits += [numpy_helper.from_array(np.ones(HIDDEN, np.float16), f"{p}.norm.weight"),
                  _weight(rng, f"{p}.qkv_proj.weight", (HIDDEN, qkv_width), HIDDEN ** -0.5),
                  _weight(rng, f"{p}.o_proj.weight", (HEADS * HEAD_SIZE, HIDDEN), HIDDEN ** -0.5)]
        nodes += [
            helper.make_node("RMSNormalization", [h, f"{p}.norm.weight"], [f"{p}.x"], name=f"{p}.norm",
                             axis=-1, epsilon=EPS),
            helper.make_node("MatMul", [f"{p}.x", f"{p}.qkv_proj.weight"], [f"{p}.qkv"], name=f"{p}.qkv_proj"),
            make_paged_attention_node(
                {"query": f"{p}.qkv", "key_cache": past_k, "value_cache": past_v,
                 "cumulative_sequence_length": "cumulative_sequence_lengths",
                 "past_seqlens": "past_sequence_lengths", "block_table": "block_table",
                 "cos_cache": "cos_cache", "sin_cache": "sin_cache", "attention_metadata": "attention_metadata"},
                {"output": f"{p}.attn", "key_cache_out": present_k, "value_cache_out": present_v},
                name=f"{p}.attn", num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1),
            helper.make_node("MatMul", [f"{p}.attn", f"{p}.o_proj.weight"], [f"{p}.o"], name=f"{p}.o_proj"),
            helper.make_node("Add", [h, f"{p}.o"], [f"h{i + 1}"], name=f"{p}.residual"),
        ]
        h = f"h{i + 1}"
    inits += [numpy_helper.from_array(np.ones(HIDDEN, np.float16), "final_norm.weight"),
              _weight(rng, "lm_head.weight", (HIDDEN, VOCAB), HIDDEN ** -0.5)]
    nodes += [
        helper.make_node("RMSNormalization", [h, "final_norm.weight"], ["hn"], name="final_norm",
                         axis=-1, epsilon=EPS),
        helper.make_node("MatMul", ["hn", "lm_head.weight"], ["logits"], name="lm_head"),
    ]
    graph = helper.make_graph(nodes, "tiny_paged", inputs, outputs, inits)
    model = helper.make_model(graph, producer_name="pagedkit examples/make_tiny_paged.py", ir_version=11,
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    return model


def genai_config() -> dict:
    """onnxruntime-genai's genai_config.json for the paged layout (as its builder writes it)."""
    return {
        "model": {
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "context_length": MAX_POS,
            "type": "llama", "vocab_size": VOCAB,
            "decoder": {
                "filename": "model.onnx", "head_size": HEAD_SIZE, "hidden_size": HIDDEN,
                "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": LAYERS,
                "inputs": {
                    "input_ids": "input_ids", "block_table": "block_table",
                    "cumulative_sequence_lengths": "cumulative_sequence_lengths",
                    "past_sequence_lengths": "past_sequence_lengths", "attention_metadata": "attention_metadata",
                    "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "state_groups": [{"kind": "paged_kv", "layer_ids": list(range(LAYERS))}],
            },
        },
        "search": {"max_length": MAX_POS, "past_present_share_buffer": True, "do_sample": False},
        "engine": {"dynamic_batching": {"block_size": BLOCK_SIZE, "max_batch_size": 16}},
    }


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    onnx.save(build_model(), str(out / "model.onnx"))
    (out / "genai_config.json").write_text(json.dumps(genai_config(), indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out / 'model.onnx'} and {out / 'genai_config.json'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "tiny-paged")
