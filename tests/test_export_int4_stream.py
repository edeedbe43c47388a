"""`--weights int4` streamed (pagedkit/exporters/int4_stream.py): the rewrite onnxruntime's MatMulNBitsQuantizer
does on the whole float graph (quantize.quantize_weights_int4, the reference: the in-memory path of before) is done
on the graph builder, and the int4 weights are quantized chunk by chunk of output columns as they are written.
The result must be the reference's, node for node and tensor for tensor, byte for byte: tied and untied heads
(GatherBlockQuantized, with the Slice of a hidden size that is not whole blocks), a float LM head, MoE experts to
QMoE, float32 routers, MLA's 3-D weights left float, bfloat16 and float32 graphs.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import numpy_helper

from export_utils import tiny_model

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, head_dim=8,
           num_key_value_heads=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)
CASES = {  # name -> (config class, overrides, ExportOptions dtype, lm_head, accuracy_level)
    "llama-tied-slice": ("LlamaConfig", dict(tie_word_embeddings=True, hidden_size=80, head_dim=16), "fp16", True, 4),
    "llama-untied": ("LlamaConfig", dict(attention_bias=True), "fp16", True, 0),
    "llama-float-head": ("LlamaConfig", dict(tie_word_embeddings=True), "fp16", False, 4),
    "qwen3-bf16": ("Qwen3Config", dict(tie_word_embeddings=True), "bf16", True, 4),
    "phi3-fp32": ("Phi3Config", dict(original_max_position_embeddings=256), "fp32", True, 4),
    "mixtral-qmoe": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), "fp16", True, 4),
    "gpt_oss-qmoe-bf16": ("GptOssConfig", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2), "bf16",
                          True, 4),
    "deepseek_v3-mla": ("DeepseekV3Config", MLA | dict(q_lora_rank=24, n_routed_experts=4, num_experts_per_tok=2,
                                                       n_group=2, topk_group=1), "fp16", True, 4),
}


def _tensors(model: onnx.ModelProto, base) -> list[tuple[str, list, int, bytes]]:
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    out = []
    for t in model.graph.initializer:
        t = onnx.TensorProto.FromString(t.SerializeToString())
        if uses_external_data(t):
            load_external_data_for_tensor(t, str(base))
            t.ClearField("external_data")
            t.data_location = onnx.TensorProto.DEFAULT
        out.append((t.name, list(t.dims), t.data_type, numpy_helper.to_array(t).tobytes()))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_int4_equals_the_in_memory_quantizer(name, tmp_path, monkeypatch):
    import pagedkit.exporters.export as ex
    import pagedkit.exporters.external as ext
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.quantize import quantize_weights_int4

    cls, kw, dtype, lm_head, level = CASES[name]
    hf = tiny_model(cls, seed=2, **kw)
    opts = ExportOptions(dtype=dtype, progress=False)
    ref, _ = ex.build_model(hf, opts)
    ref = quantize_weights_int4(ref, accuracy_level=level, lm_head=lm_head)
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    monkeypatch.setattr(ext, "CHUNK_BYTES", 300)  # every int4 weight quantized in several column chunks
    got, _ = ex.build_model(hf, opts, external_data=tmp_path / "m.data", int4=(32, level, lm_head))
    assert [n.SerializeToString() for n in got.graph.node] == [n.SerializeToString() for n in ref.graph.node]
    a, b = _tensors(ref, tmp_path), _tensors(got, tmp_path)
    assert [x[:3] for x in b] == [x[:3] for x in a]
    for x, y in zip(a, b):
        assert x[3] == y[3], x[0]
    ops = {n.op_type for n in got.graph.node}
    assert "MatMulNBits" in ops and ("QMoE" in ops) == ("qmoe" in name or "deepseek" in name)
    assert ("GatherBlockQuantized" in ops) == (kw.get("tie_word_embeddings", False) and lm_head)


def test_int4_export_streams_the_checkpoint(tmp_path):
    """`export(..., weights="int4")` of a sharded checkpoint: read tensor by tensor (the summary says so), and the
    same files as from the model loaded whole (from_pretrained)."""
    import filecmp

    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions

    tiny_model("LlamaConfig", seed=4, tie_word_embeddings=True).save_pretrained(tmp_path / "ckpt",
                                                                                 max_shard_size="40KB")
    got = export(str(tmp_path / "ckpt"), tmp_path / "got", ExportOptions(progress=False), weights="int4")
    assert "streamed" in got.summary() and "lm_head MatMulNBits, embedding GatherBlockQuantized" in got.summary()
    export(str(tmp_path / "ckpt"), tmp_path / "ref", ExportOptions(progress=False), weights="int4", stream=False,
           validate=False)
    assert filecmp.cmp(tmp_path / "got" / "model.onnx", tmp_path / "ref" / "model.onnx", shallow=False)
