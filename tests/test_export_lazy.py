"""Lazy weights (pagedkit/exporters/lazy.py): a family's weight transforms are recorded while the graph is
built and evaluated per tensor when each initializer is written, so the same family code exports from a model
on the meta device whose tensors are read one at a time from its safetensors checkpoint (the basis of streaming
export): bit-identical initializers to the in-memory export, for every family kind (packed QKV, fused gate_up,
(1 + w) gains, MoE experts, MLA absorption)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from export_utils import tiny_model


def test_lazy_ops_match_eager():
    from pagedkit.exporters.lazy import LazyTensor, lazy, materialize

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    lw, lb = lazy(w), lazy(b)
    cases = {
        "t": (lambda x, y: x.detach().t(), lambda x, y: x.t()),
        "cat": (lambda x, y: torch.cat([x, torch.zeros(2, 4)], 0), None),
        "chunk": (lambda x, y: x.chunk(2, dim=0)[1], None),
        "stack": (lambda x, y: torch.stack(list(x.chunk(2, 0)), dim=2).reshape(6, 4), None),
        "gain": (lambda x, y: 1.0 + y.float(), None),
        "index": (lambda x, y: x[:, 1:3], None),
        "split": (lambda x, y: x.split([2, 4], 0)[1].transpose(0, 1), None),
        "cast": (lambda x, y: x.to(torch.float16), None),
    }
    for name, (f, ref) in cases.items():
        got = f(lw, lb)
        assert isinstance(got, LazyTensor), name
        want = (ref or f)(w, b)
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.equal(materialize(got), want), name
    assert lw.shape[0] == 6 and lw.dim() == 2 and lw.numel() == 24
    assert float(lb.abs().max()) == float(b.abs().max())  # data-dependent: evaluated at once


def test_in_place_transform_refused():
    from pagedkit.exporters.lazy import lazy

    with pytest.raises(RuntimeError, match="in-place mul_"):
        lazy(torch.ones(3)).mul_(2)


def test_weights_are_evaluated_when_written(monkeypatch):
    """Building a graph evaluates no weight; writing it evaluates each; the result equals the eager values."""
    import pagedkit.exporters.lazy as lz
    from pagedkit.exporters.families.base import ExportContext, ExportOptions
    from pagedkit.exporters.registry import family_for

    hf = tiny_model("LlamaConfig", seed=2, tie_word_embeddings=True)
    calls = []
    real = lz.lazy

    def counting(value, thunk=None):
        v = value.detach()
        return real(v, lambda: calls.append(1) or v)

    monkeypatch.setattr(lz, "lazy", counting)
    family = family_for(hf.config)
    ctx = ExportContext(family, hf, ExportOptions(progress=False))
    with torch.no_grad(), lz.lazy_parameters(hf):
        family.build(ctx)
    assert not calls, f"{len(calls)} weights evaluated while the graph was built"
    proto = ctx.g.model("m", "test")
    assert calls
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    emb = hf.model.embed_tokens.weight.detach().half().numpy()
    np.testing.assert_array_equal(inits["model.embed_tokens.weight"], emb)
    assert "lm_head.MatMul.weight" not in inits  # tied: one object, recognized through the lazy view
    q = hf.model.layers[1].self_attn
    packed = torch.cat([q.q_proj.weight, q.k_proj.weight, q.v_proj.weight]).t().detach().half().numpy()
    np.testing.assert_array_equal(inits["model.layers.1.attn.qkv_proj.MatMul.weight"], packed)


STREAMED = {  # model -> (config class, overrides): every way a family transforms checkpoint tensors
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", {}),
    "phi3-fused": ("Phi3Config", dict(original_max_position_embeddings=256)),
    "gemma2-gains": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24)),
    "gpt_oss-moe": ("GptOssConfig", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("name", sorted(STREAMED))
def test_export_from_checkpoint_on_meta_equals_in_memory(name, tmp_path):
    """The model built on the meta device (no weights in memory), its tensors read from the (sharded)
    safetensors checkpoint one at a time when written: the same graph, bit-identical initializers."""
    import transformers

    from pagedkit.exporters.export import build_model
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.checkpoint import checkpoint_parameters

    cls, kw = STREAMED[name]
    hf = tiny_model(cls, seed=7, **kw)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")  # several shards + index
    assert (tmp_path / "model.safetensors.index.json").exists()
    want, _ = build_model(hf, ExportOptions(progress=False))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf.config, attn_implementation="eager")
    assert all(p.device.type == "meta" for p in meta.parameters())
    with checkpoint_parameters(meta, tmp_path):
        got, _ = build_model(meta, ExportOptions(progress=False))
    assert [n.name for n in got.graph.node] == [n.name for n in want.graph.node]
    a = {t.name: t for t in want.graph.initializer}
    b = {t.name: t for t in got.graph.initializer}
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].raw_data == b[k].raw_data and list(a[k].dims) == list(b[k].dims), k


def test_per_expert_checkpoint_is_merged_as_transformers_loads_it(tmp_path):
    """transformers stores MoE experts one tensor per expert (Mixtral: block_sparse_moe.experts.{e}.w1 / w2 / w3)
    and fuses them when it loads (its conversion mapping): the lazy parameters replay that merge, equal to
    from_pretrained's tensors bit for bit, and an expert missing from the checkpoint is named."""
    import transformers
    from safetensors.torch import load_file, save_file

    from pagedkit.exporters.checkpoint import checkpoint_parameters
    from pagedkit.exporters.lazy import materialize

    hf = tiny_model("MixtralConfig", seed=1, num_local_experts=4, num_experts_per_tok=2)
    hf.save_pretrained(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf.config)
    with checkpoint_parameters(meta, tmp_path):
        got = dict(meta.named_parameters())
        for name, p in ref.named_parameters():
            assert torch.equal(materialize(got[name]), p.detach()), name
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.experts.gate_up_proj"):
        with checkpoint_parameters(meta, tmp_path):
            pass


def test_checkpoint_missing_tensor_is_named(tmp_path):
    import transformers

    from pagedkit.exporters.checkpoint import checkpoint_parameters

    hf = tiny_model("LlamaConfig", seed=1)
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf.config)
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        with checkpoint_parameters(meta, tmp_path):
            pass


def test_docs_example_runs(tmp_path):
    """The example in docs/export.md's "Lazy weights" section, on a tiny checkpoint."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    section = text[text.index("## Lazy weights"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    tiny_model("Qwen3Config", seed=3).save_pretrained(tmp_path, max_shard_size="40KB")
    scope: dict = {}
    exec(compile(code.replace("./my-checkpoint", str(tmp_path)), "docs/export.md", "exec"), scope)
    assert scope["spec"].model_type and len(scope["proto"].graph.initializer) > 10


def test_weights_stream_to_the_data_file(tmp_path, monkeypatch):
    """Above EXTERNAL_DATA_BYTES, the export writes each initializer to model.onnx.data as it is evaluated (the
    proto keeps locations only): the saved model equals the in-memory export's, tensor by tensor, and runs."""
    import pagedkit.exporters.export as ex
    from export_utils import check_parity, export_tiny

    hf = tiny_model("Qwen3Config", seed=5)
    want, _ = ex.build_model(hf)
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    streamed, _ = ex.build_model(hf, external_data=tmp_path / "probe.data")
    big = [t for t in streamed.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert big and all(not t.raw_data for t in big)
    export_tiny(hf, tmp_path / "out")
    assert (tmp_path / "out" / "model.onnx.data").exists()
    got = onnx.load(str(tmp_path / "out" / "model.onnx"))
    a = {t.name: onnx.numpy_helper.to_array(t) for t in want.graph.initializer}
    b = {t.name: onnx.numpy_helper.to_array(t) for t in got.graph.initializer}
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    check_parity(hf, tmp_path / "out", steps=2)
