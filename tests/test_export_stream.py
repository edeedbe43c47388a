"""Streaming export (pagedkit/exporters/checkpoint.py, slicing.py, external.py): a safetensors checkpoint is read
tensor by tensor — large initializers row chunk by row chunk — while the weights are written to external data,
never loaded whole.

The reference is today's in-memory path (`export(..., stream=False)`: from_pretrained, every initializer
evaluated whole); the streamed export must equal it byte for byte (model.onnx and its data), for every way a
family transforms checkpoint tensors, with chunks small enough that every initializer is cut. `narrow` is checked
against eager slicing rule by rule. Peak memory: tests/test_export_stream_rss.py (slow).
"""

from __future__ import annotations

import filecmp
import math

import onnx
import pytest
import torch

from export_utils import tiny_model

MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, head_dim=8,
           num_key_value_heads=4, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1)
FAMILIES = {  # every way a family transforms checkpoint tensors (packed QKV, fused gate_up, gains, experts, MLA)
    "llama-untied": ("LlamaConfig", dict(attention_bias=True)),
    "qwen3-tied": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "phi3-fused": ("Phi3Config", dict(original_max_position_embeddings=256)),
    "gemma2-gains": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=24)),
    "gpt_oss-fp32-norms": ("GptOssConfig", dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-per-expert": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe-shared": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48)),
    "phimoe-renamed": ("PhimoeConfig", dict(num_local_experts=4, attention_bias=True, lm_head_bias=True)),
    "granitemoe-renamed": ("GraniteMoeConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3-mla": ("DeepseekV3Config", MLA | dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=3,
                                                       n_group=4, topk_group=2, num_hidden_layers=3)),
}


def _export_pair(cls, kw, tmp_path, monkeypatch, chunk: int = 256, **export_kw):
    """(reference folder, streamed folder): the in-memory export, and the streamed one with every initializer
    in external data written in chunks of `chunk` bytes."""
    import pagedkit.exporters.checkpoint as ck
    import pagedkit.exporters.export as ex
    import pagedkit.exporters.external as ext
    from pagedkit.exporters.families.base import ExportOptions

    hf = tiny_model(cls, seed=3, **kw)
    ckpt = tmp_path / "ckpt"
    hf.save_pretrained(ckpt, max_shard_size="60KB")
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    opts = ExportOptions(progress=False)
    ex.export(str(ckpt), tmp_path / "ref", opts, stream=False, validate=False, **export_kw)
    monkeypatch.setattr(ext, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(ck, "READ_BYTES", 1000)  # conversions on reading in row chunks too
    ex.export(str(ckpt), tmp_path / "got", opts, stream=True, **export_kw)
    return tmp_path / "ref", tmp_path / "got"


def _same_files(a, b) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for n in names:
        assert filecmp.cmp(a / n, b / n, shallow=False), f"{n} differs"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_streamed_export_is_byte_identical(name, tmp_path, monkeypatch):
    cls, kw = FAMILIES[name]
    ref, got = _export_pair(cls, kw, tmp_path, monkeypatch)
    assert (got / "model.onnx.data").stat().st_size > 100_000
    _same_files(ref, got)


def test_streamed_reads_rows_not_whole_tensors(tmp_path, monkeypatch):
    """The chunks really come from row reads: an untransposed table (the embedding) and per-expert tensors are
    read in row ranges or one expert at a time, never whole; a transposed weight is read whole once per
    initializer (its rows are the source's columns), not once per chunk."""
    import pagedkit.exporters.checkpoint as ck

    reads = []
    real = ck._Reader.__call__

    def spy(self, rows=None):
        reads.append((self.key, rows))
        return real(self, rows)

    monkeypatch.setattr(ck._Reader, "__call__", spy)
    _export_pair("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), tmp_path, monkeypatch,
                 chunk=4096)
    emb = [r for k, r in reads if k == "model.embed_tokens.weight"]
    assert emb and all(r is not None for r in emb) and len(emb) > 2  # 144 x 64 fp16 = 18 KB: 5 chunks
    head = [r for k, r in reads if k == "lm_head.weight"]
    assert head == [None]  # transposed: whole, once
    expert = [r for k, r in reads if k == "model.layers.0.block_sparse_moe.experts.0.w1.weight"]
    assert expert == [None]  # fc1 chunks are whole experts, each expert read once


def test_max_shard_size_splits_the_data(tmp_path, monkeypatch):
    """--max-shard-size: several data files, none past the limit (a tensor is never split), the model loads and
    equals the one-file export tensor by tensor; the validator accepts it."""
    from onnx import numpy_helper

    from pagedkit.exporters.external import data_files

    ref, got = _export_pair("LlamaConfig", {}, tmp_path, monkeypatch, max_shard_size="40KB")
    files = data_files(got / "model.onnx")
    assert len(files) > 3 and all(f.stat().st_size <= 40_000 for f in files)
    a = onnx.load(str(ref / "model.onnx"))
    b = onnx.load(str(got / "model.onnx"))
    bare = onnx.load(str(got / "model.onnx"), load_external_data=False)
    locs = {e.value for t in bare.graph.initializer for e in t.external_data if e.key == "location"}
    assert locs == {f.name for f in files}
    for x, y in zip(a.graph.initializer, b.graph.initializer):
        assert x.name == y.name and numpy_helper.to_array(x).tobytes() == numpy_helper.to_array(y).tobytes()


def test_parse_size():
    from pagedkit.exporters.external import parse_size

    assert parse_size("4GB") == 4 * 10 ** 9 and parse_size("1.5GiB") == 3 * 2 ** 29 and parse_size(None) is None
    assert parse_size("off") is None and parse_size("512MB") == 512 * 10 ** 6 and parse_size(1000) == 1000
    with pytest.raises(ValueError):
        parse_size("4 parsecs")


# ---- narrow: slice rules against eager slicing ---------------------------------------------------------------

def _leaves(*shapes, seed=0):
    """LazyTensor leaves over random values, with row readers (dim 0) that record what they were asked."""
    from pagedkit.exporters.lazy import LazyTensor

    gen = torch.Generator().manual_seed(seed)
    asked = []
    out = []
    for j, s in enumerate(shapes):
        v = torch.randn(s, generator=gen)

        def slicer(d, a, b, v=v, j=j):
            asked.append((j, d, a, b))
            return v[a:b] if d == 0 else None
        out.append((LazyTensor(v.to("meta"), lambda v=v: v, slicer), v))
    return out, asked


def _cases():
    (a, va), (b, vb), (c, vc) = _leaves((6, 4, 5), (6, 4, 5), (3, 4, 5))[0]
    (w, vw), = _leaves((12, 8), seed=1)[0]
    return {
        "t": (w.t(), vw.t()),
        "transpose": (a.transpose(0, 2), va.transpose(0, 2)),
        "permute": (a.permute(2, 0, 1), va.permute(2, 0, 1)),
        "reshape-merge": (a.reshape(6, 20), va.reshape(6, 20)),
        "reshape-split-rows": (w.reshape(3, 4, 8), vw.reshape(3, 4, 8)),
        "reshape-join-rows": (w.reshape(6, 16), vw.reshape(6, 16)),
        "chunk-same-dim": (w.chunk(3, dim=0)[1], vw.chunk(3, dim=0)[1]),
        "split-other-dim": (a.split([1, 3], dim=1)[1], va.split([1, 3], dim=1)[1]),
        "cat-same-dim": (torch.cat([a, c], 0), torch.cat([va, vc], 0)),
        "cat-other-dim": (torch.cat([a, b], 1), torch.cat([va, vb], 1)),
        "stack-new-dim": (torch.stack([a, b], 0), torch.stack([va, vb], 0)),
        "stack-inner": (torch.stack([a, b], 2).reshape(6, 8, 5), torch.stack([va, vb], 2).reshape(6, 8, 5)),
        "getitem": (a[:, 1:3, 2], va[:, 1:3, 2]),
        "getitem-rows": (w[2:10], vw[2:10]),
        "narrow": (a.narrow(1, 1, 2), va.narrow(1, 1, 2)),
        "elementwise": ((1.0 + a.float()).half() * b[0:1], ((1.0 + va.float()).half() * vb[0:1])),
        "moe-interleave": (torch.stack([a.detach().chunk(2, dim=1)[0], a.chunk(2, dim=1)[1]], 2).reshape(6, 4, 5),
                           torch.stack(list(va.chunk(2, dim=1)), 2).reshape(6, 4, 5)),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_narrow_equals_eager_slice(case):
    from pagedkit.exporters import slicing

    lazy, want = _cases()[case]
    for d in range(want.dim()):
        n = want.shape[d]
        for a, b in ((0, 1), (1, n), (n // 2, n), (max(0, n // 2 - 1), min(n, n // 2 + 2))):
            if a >= b:
                continue
            got = slicing.narrow(lazy, d, a, b)
            slicing.clear()
            assert torch.equal(got, want.narrow(d, a, b - a)), (case, d, a, b)


def test_narrow_reads_only_the_rows_it_needs():
    """Rows of stack(experts) read only those experts; rows of cat([q, k], 0) read each part's own rows."""
    from pagedkit.exporters import slicing

    leaves, asked = _leaves(*[(4, 3)] * 4)
    experts = torch.stack([t for t, _ in leaves], 0)
    slicing.narrow(experts, 0, 1, 3)
    assert asked == []  # whole experts, materialized (no slicing needed)
    packed = torch.cat([leaves[0][0], leaves[1][0]], 0)  # [8, 3]
    got = slicing.narrow(packed, 0, 2, 6)
    assert torch.equal(got, torch.cat([leaves[0][1], leaves[1][1]], 0)[2:6])
    assert asked == [(0, 0, 2, 4), (1, 0, 0, 2)]
    slicing.clear()


def test_chunked_writer_bytes_equal_tensor_proto(tmp_path, monkeypatch):
    """external.ExternalData writes exactly graph.tensor_proto's bytes, chunked or not, any dtype."""
    import pagedkit.exporters.external as ext
    from onnx import TensorProto

    from pagedkit.exporters.graph import tensor_proto
    from pagedkit.exporters.lazy import lazy

    monkeypatch.setattr(ext, "CHUNK_BYTES", 100)
    v = torch.randn(37, 11)
    with ext.ExternalData(tmp_path / "d.data") as sink:
        protos = [sink.write(f"t{j}", lazy(v).t() * 3, et) for j, et in
                  enumerate((TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT))]
    data = (tmp_path / "d.data").read_bytes()
    for p, et in zip(protos, (TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.FLOAT)):
        meta = {e.key: e.value for e in p.external_data}
        off, n = int(meta["offset"]), int(meta["length"])
        assert data[off:off + n] == tensor_proto("x", v.t() * 3, et).raw_data
        assert math.prod(p.dims) == v.numel()


# ---- real sizes: synthetic checkpoints on disk, the CLI in a child process ------------------------------------

LLAMA = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=32000, hidden_size=1024,
             intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
GIB = 1 << 30


def _cli(ckpt, out, *extra) -> list[str]:
    import sys

    return [sys.executable, "-m", "pagedkit.exporters.cli", "--model", str(ckpt), "--output", str(out), "--quiet",
            *extra]


def test_synthetic_checkpoint_streams_byte_identical(tmp_path, monkeypatch):
    """A ~110 MB Llama-shaped bf16 checkpoint in shards, exported in-process with 2 MiB chunks: byte identical to
    the in-memory export (its embedding and LM head are written in 16 chunks each)."""
    import pagedkit.exporters.export as ex
    import pagedkit.exporters.external as ext
    from export_stream_utils import synthetic_checkpoint
    from pagedkit.exporters.families.base import ExportOptions

    info = synthetic_checkpoint(tmp_path / "ckpt", LLAMA | dict(vocab_size=16000, num_hidden_layers=2),
                                shard_bytes=40 << 20)
    assert info["bytes"] > 100e6 and len(list((tmp_path / "ckpt").glob("*.safetensors"))) >= 3
    opts = ExportOptions(progress=False)
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)  # weights to model.onnx.data, as above 256 MiB
    ex.export(str(tmp_path / "ckpt"), tmp_path / "ref", opts, stream=False, validate=False)
    monkeypatch.setattr(ext, "CHUNK_BYTES", 2 << 20)
    ex.export(str(tmp_path / "ckpt"), tmp_path / "got", opts)
    _same_files(tmp_path / "ref", tmp_path / "got")


def test_docs_streaming_example_runs(tmp_path):
    """The Python example of docs/export.md's "Streaming export" section, on a tiny sharded checkpoint."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    section = text[text.index("## Streaming export"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    tiny_model("Qwen3Config", seed=3).save_pretrained(tmp_path / "ckpt", max_shard_size="40KB")
    code = code.replace("./my-checkpoint", str(tmp_path / "ckpt")).replace("./my-export", str(tmp_path / "out"))
    scope: dict = {}
    exec(compile(code, "docs/export.md", "exec"), scope)
    assert "streamed" in scope["result"].summary() and (tmp_path / "out" / "model.onnx").exists()


@pytest.mark.parametrize("cls,kw", [
    ("DeepseekV3Config", MLA | dict(q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                    topk_group=1)),
    ("GptOssConfig", dict(sliding_window=8, num_local_experts=8, num_experts_per_tok=2)),
])
def test_num_experts_reads_the_first_experts_of_a_larger_checkpoint(cls, kw, tmp_path):
    """--num-experts 4 on an 8-expert checkpoint: per-expert tensors past 4 are skipped, and tensors with a row per
    expert (router [E, H] and its bias, DeepSeek's e_score_correction_bias [E], GPT-OSS's fused [E, ...] experts)
    are read up to row 4: the export equals the in-memory export of the model cut to 4 experts by hand."""
    import transformers

    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.weights import shrink_config

    hf = tiny_model(cls, seed=4, **kw)
    hf.save_pretrained(tmp_path / "full", max_shard_size="60KB")
    cut = transformers.AutoModelForCausalLM.from_config(shrink_config(hf.config, num_experts=4))
    with torch.no_grad():
        full = dict(hf.state_dict())
        for name, t in cut.state_dict().items():
            t.copy_(full[name][:t.shape[0]] if full[name].shape != t.shape else full[name])
    cut.save_pretrained(tmp_path / "cut")
    opts = ExportOptions(progress=False)
    export(str(tmp_path / "full"), tmp_path / "got", opts, num_experts=4)
    export(str(tmp_path / "cut"), tmp_path / "ref", opts, stream=False, validate=False)
    assert filecmp.cmp(tmp_path / "got" / "model.onnx", tmp_path / "ref" / "model.onnx", shallow=False)


def test_cli_max_shard_size_and_no_stream(tmp_path, capsys, monkeypatch):
    """--max-shard-size is parsed before anything is loaded (a bad size: exit 2, one line); with it the CLI writes
    several data files; --no-stream gives the same files as the streamed default."""
    import pagedkit.exporters.export as ex
    from pagedkit.exporters.cli import main
    from pagedkit.exporters.external import data_files

    with pytest.raises(SystemExit) as exc:
        main(["--model", str(tmp_path / "nowhere"), "--output", str(tmp_path / "o"), "--max-shard-size", "4 parsecs"])
    assert exc.value.code == 2 and "--max-shard-size" in capsys.readouterr().err
    tiny_model("LlamaConfig", seed=1).save_pretrained(tmp_path / "ckpt")
    monkeypatch.setattr(ex, "EXTERNAL_DATA_BYTES", 0)
    assert main(["--model", str(tmp_path / "ckpt"), "--output", str(tmp_path / "a"), "--quiet",
                 "--max-shard-size", "50KB"]) == 0
    assert "external data:" in capsys.readouterr().out and len(data_files(tmp_path / "a" / "model.onnx")) > 2
    assert main(["--model", str(tmp_path / "ckpt"), "--output", str(tmp_path / "b"), "--quiet", "--no-stream",
                 "--max-shard-size", "50KB"]) == 0
    _same_files(tmp_path / "a", tmp_path / "b")
