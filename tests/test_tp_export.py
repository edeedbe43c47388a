"""`paged-export --tp N` without running it: the cut's arithmetic (which heads, KV heads and rows each rank
takes), what is refused (naming the count or the tensor), the rank graphs' collectives in bfloat16, int4 shards on
quantization-block boundaries, and the validator's collective rules (paged-validate over every rank of a folder).
Running the sets: tests/test_tp_run.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
import torch

import tp_harness as H

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parent.parent


def _plan(world, heads=4, kv=2, vocab=144, latent=False):
    from pagedkit.exporters.tp.plan import ShardPlan

    return ShardPlan(world, "llama", heads, kv, vocab, latent)


def test_head_ranges():
    from pagedkit.exporters.tp.plan import KV, Q

    p = _plan(4, heads=8, kv=2)  # KV heads fewer than ranks: each KV head on 2 ranks
    assert [p.unit_range(Q, 8, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # rank r's query heads 2r, 2r+1 read KV head (2r) // 4 (groups of 4 query heads)
    assert [p.unit_range(KV, 2, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert p.kv_per_rank == 1 and not p.kv_split
    p = _plan(2, heads=8, kv=4)
    assert [p.unit_range(KV, 4, r) for r in range(2)] == [(0, 2), (2, 4)] and p.kv_per_rank == 2
    p = _plan(2, vocab=145)
    assert p.vocab_per_rank == 73 and [p.vocab_range(r) for r in range(2)] == [(0, 73), (73, 145)]


def test_fused_cuts_take_each_part():
    """A packed [q | k | v] weight and a fused [gate | up] one: each rank gets its rows of every part."""
    from pagedkit.exporters.tp.plan import KV, Q, Rule, shard

    p = _plan(2, heads=4, kv=2)
    d = 3
    w = torch.arange((4 + 2 * 2) * d).reshape(-1, 1)  # rows: q heads 0..3, k heads 0..1, v heads 0..1 (d rows each)
    r1 = shard(p, Rule(0, (Q, KV, KV)), w, 1).flatten().tolist()
    assert r1 == list(range(6, 12)) + list(range(15, 18)) + list(range(21, 24))
    gu = torch.arange(2 * 8).reshape(1, 16, 1)  # experts [E, 2I, H]: [gate 0..7 | up 8..15]
    assert shard(p, Rule(1, ("i", "i")), gu, 0).flatten().tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    inter = torch.arange(8).reshape(1, 1, 8)  # GPT-OSS [g0, u0, g1, u1, ...]: pairs
    assert shard(p, Rule(2, ("i2",)), inter, 1).flatten().tolist() == [4, 5, 6, 7]
    bias = torch.ones(5)
    assert shard(p, Rule(rank0=True), bias, 0).sum() == 5 and shard(p, Rule(rank0=True), bias, 1).sum() == 0


@pytest.mark.parametrize("overrides,world,match", [
    (dict(), 3, "4 attention heads are not divisible by 3"),
    (dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8), 2,
     "3 KV heads neither divide into 2 ranks"),
    (dict(intermediate_size=97), 2, "mlp.gate_proj.weight.*do not split into 2 equal parts"),
])
def test_refusals_name_the_count(overrides, world, match):
    from pagedkit.exporters.registry import family_for
    from pagedkit.exporters.tp.plan import ShardError, make_plan

    hf = H.Case("LlamaConfig", tuple(overrides.items())).model()
    with pytest.raises(ShardError, match=match):
        make_plan(hf, family_for(hf.config), world)


def test_unsupported_family_is_refused():
    from pagedkit.exporters.registry import family_for
    from pagedkit.exporters.tp.plan import ShardError, make_plan

    hf = H.Case("Olmo2Config").model()  # its QK-norm spans every head: a cross-rank reduction
    with pytest.raises(ShardError, match="olmo2 family is not supported with tensor parallelism"):
        make_plan(hf, family_for(hf.config), 2)


def test_int4_shards_on_block_boundaries(tmp_path):
    """intermediate 96: each rank's 48 input features of down_proj are not whole blocks of 32: refused, naming the
    tensor; 128 (64 a rank) exports, and each rank's int4 codes and scales are byte for byte its part of the
    single-device int4 export's (row-parallel: whole blocks; column-parallel: rows)."""
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp.export import export_tp_model
    from pagedkit.exporters.tp.plan import ShardError

    with pytest.raises(ShardError, match=r"int4 weights: model\.layers\.0\.mlp\.down_proj\.weight \(64, 96\): each "
                                         r"rank's 48 input features .* not whole quantization blocks of 32"):
        export_tp_model(H.Case("LlamaConfig").model(), tmp_path / "bad", ExportOptions(dtype="fp32", progress=False),
                        tp=2, weight_format="int4")
    from onnx import numpy_helper

    from pagedkit.exporters.export import export_hf_model

    hf = H.Case("LlamaConfig", (("intermediate_size", 128),)).model()
    out, one = tmp_path / "ok", tmp_path / "one"
    export_tp_model(hf, out, ExportOptions(dtype="fp32", progress=False), tp=2, weight_format="int4")
    export_hf_model(hf, one, ExportOptions(dtype="fp32", progress=False), weight_format="int4")
    full = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(one / "model.onnx")).graph.initializer}
    for r in range(2):
        m = onnx.load(str(out / f"rank_{r}" / "model.onnx"))
        ops = [n.op_type for n in m.graph.node]
        assert ops.count("MatMulNBits") == 2 * 5 + 1 and ops.count("AllReduce") == 4  # qkv o gate up down, lm_head
        mine = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
        for name, blocks in (("model.layers.1.mlp.down_proj", True), ("model.layers.0.attn.o_proj", True),
                             ("model.layers.1.mlp.up_proj", False), ("lm_head", False)):
            for part in ("_Q4", "_scales"):  # the rank's codes and scales are exactly its rows / blocks of the model's
                key = f"{name}.MatMul.weight{part}"
                n = mine[key].shape[1 if blocks else 0]
                want = full[key][:, r * n:(r + 1) * n] if blocks else full[key][r * n:(r + 1) * n]
                assert (mine[key] == want).all(), key


def test_bf16_reduces_in_float32(tmp_path):
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp.export import export_tp_model

    out = tmp_path / "bf16"
    export_tp_model(H.Case("LlamaConfig").model(), out, ExportOptions(dtype="bf16", progress=False), tp=2)
    m = onnx.load(str(out / "rank_1" / "model.onnx"))
    producer = {o: n for n in m.graph.node for o in n.output}
    for n in m.graph.node:
        if n.op_type in ("AllReduce", "AllGather"):
            src = producer[n.input[0]]
            typ = next(a.i for a in src.attribute if a.name == "to") if src.op_type == "Cast" else None
            assert n.op_type == "AllGather" or typ == onnx.TensorProto.FLOAT, (n.name, src.op_type)
    logits = next(o for o in m.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT


def _validate(folder) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedkit.validators.cli", str(folder)], capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_paged_validate_checks_every_rank(tmp_path):
    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp.export import export_tp_model

    out = tmp_path / "tp"
    export_tp_model(H.Case("LlamaConfig").model(), out, ExportOptions(dtype="fp32", progress=False), tp=2)
    ok = _validate(out)
    assert ok.returncode == 0 and ok.stdout.strip() == "OK: 4 attention nodes checked", ok
    m = onnx.load(str(out / "rank_1" / "model.onnx"))
    next(a for n in m.graph.node if n.op_type == "AllGather" for a in n.attribute if a.name == "group_size").i = 3
    onnx.save(m, str(out / "rank_1" / "model.onnx"))
    bad = _validate(out)
    assert bad.returncode == 1 and "attribute 'group_size': expected 2 (pagedkit.tensor_parallel.world_size), got 3 " \
                                   "[MODEL-collective-group]" in bad.stdout, bad


def test_collectives_without_a_set_in_the_config(tmp_path):
    from pagedkit.validators import validate_model

    from pagedkit.exporters.families.base import ExportOptions
    from pagedkit.exporters.tp.export import export_tp_model

    out = tmp_path / "tp"
    export_tp_model(H.Case("LlamaConfig").model(), out, ExportOptions(dtype="fp32", progress=False), tp=2)
    cfg = json.loads((out / "genai_config.json").read_text())
    section = json.loads(cfg["pagedkit"])
    del section["tensor_parallel"]
    cfg["pagedkit"] = json.dumps(section)
    issues = validate_model(str(out / "rank_0" / "model.onnx"), genai_config=cfg)
    assert [i.rule for i in issues] == ["MODEL-collective-group"], issues
    assert validate_model(str(out / "rank_0" / "model.onnx"), genai_config=json.loads(
        (out / "genai_config.json").read_text())) == []


def test_paged_export_cli(tmp_path, capsys):
    from pagedkit.exporters.cli import main

    src = tmp_path / "ckpt"
    src.mkdir()
    H.Case("LlamaConfig").model().config.save_pretrained(src)  # config only: random weights
    assert main(["--model", str(src), "--quiet", "--output", str(tmp_path / "out"), "--tp", "2", "--dtype", "fp32"]) == 0
    assert "tensor parallel: 2 ranks" in capsys.readouterr().out
    assert all((tmp_path / "out" / f"rank_{r}" / "model.onnx").is_file() for r in range(2))
    assert main(["--model", str(src), "--quiet", "--output", str(tmp_path / "bad"), "--tp", "3"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == ["paged-export: error: --tp 3: 4 attention heads are not divisible by 3"]


def test_static_kv_scales_are_the_ranks_heads(tmp_path):
    """int8 PER_CHANNEL caches: the scales are calibrated once on the uncut graph (the single-device export's own),
    and rank r's [kv_heads / N, 1, D] scale is rank r's KV heads' rows of it."""
    from onnx import numpy_helper

    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions, KVOptions
    from pagedkit.exporters.tp.export import export_tp_model

    hf = H.Case("LlamaConfig").model()
    kv = KVOptions(k_dtype="int8", v_dtype="int8", k_quant="PER_CHANNEL", v_quant="PER_CHANNEL")
    export_hf_model(hf, tmp_path / "one", ExportOptions(dtype="fp32", kv=kv, progress=False))
    export_tp_model(hf, tmp_path / "two", ExportOptions(dtype="fp32", kv=kv, progress=False), tp=2)

    def scales(path):
        return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer
                if t.name.endswith(("k_scale", "v_scale"))}

    full = scales(tmp_path / "one" / "model.onnx")
    assert len(full) == 4 and all(s.shape == (2, 1, 16) for s in full.values())
    for r in range(2):
        mine = scales(tmp_path / "two" / f"rank_{r}" / "model.onnx")
        assert mine.keys() == full.keys()
        for name, s in mine.items():
            assert (s == full[name][r:r + 1]).all(), name
