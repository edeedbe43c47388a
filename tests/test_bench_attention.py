"""benchmarks/attention.py without a GPU: the byte arithmetic of the floor, and the --dry-run plumbing (CPU, tiny
shapes, torch_sdpa and reference arms, the Triton arm through the interpreter if it imports, onnxruntime's
refusal recorded as skipped) writing the JSON and the roofline plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench_modules import bench_module

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "attention.py"


@pytest.fixture(scope="module")
def cases():
    with bench_module("_attention_cases") as mod:
        yield mod


def test_traffic_and_floor(cases):
    c = cases.CASES["fp16-b16-ctx4k-bs256"]
    t = cases.traffic(c)
    assert t["kv"] == 16 * 4096 * 8 * (128 + 128) * 2
    assert t["q_kv_out"] == 16 * (32 * 128 * 2 * 2 + 8 * 256 * 2)  # Q + output, new K + V
    assert cases.floor_ms(t["total"]) == pytest.approx(t["total"] / 4.4e12 * 1e3)
    assert cases.effective_tb_s(t["total"], cases.floor_ms(t["total"])) == pytest.approx(4.4)
    # int4: half a byte per element; PER_TOKEN adds a float16 K and V scale per token and KV head
    int4 = cases.traffic(cases.CASES["int4-channel-b64-ctx8k-bs16"])
    assert int4["kv_bytes_per_token"] == 8 * 2 * 64
    tok = cases.traffic(cases.CASES["int4-token-rot-b64-ctx8k-bs16"])
    assert tok["kv_bytes_per_token"] == 8 * 2 * 64 + 8 * 2 * 2
    assert cases.traffic(cases.CASES["int8-b16-ctx4k-bs16"])["kv"] * 2 == t["kv"]
    # a window reads only its last local_window_size keys: the same KV bytes as the plain context-1024 row
    assert (cases.traffic(cases.CASES["window1k-b16-ctx8k-bs16"])["kv"]
            == cases.traffic(cases.CASES["fp16-b16-ctx1k-bs16"])["kv"])
    assert cases.traffic(cases.CASES["ragged-b16-bs16"])["tokens_read"] == sum(cases.RAGGED)
    # prefill: 4 * D * H FLOPs per admitted (query, key) pair; causal, no prefix: q (q + 1) / 2 pairs a sequence
    pre = cases.CASES["prefill-fp16-b4-q4096-bs16"]
    assert cases.flops(pre) == 4 * 128 * 32 * 4 * (4096 * 4097 // 2)
    assert cases.compute_floor_ms(cases.flops(pre)) == pytest.approx(cases.flops(pre) / 790e12 * 1e3)
    chunk = cases.CASES["chunk-fp16-b4-q1024-ctx4096-bs16"]  # 1024 queries over a 3072-token prefix
    assert cases.flops(chunk) == 4 * 128 * 32 * 4 * (1024 * 3072 + 1024 * 1025 // 2)
    assert cases.traffic(pre)["q_kv_out"] == 4 * 4096 * (32 * 128 * 2 * 2 + 8 * 256 * 2)
    # MLA (LATENT): one 576-channel latent cache row per token (V is its leading 512 channels); 2 * (576 + 512)
    # FLOPs per (query, key) pair and head
    mla = cases.CASES["mla-fp16-b64-ctx4k-bs64"]
    t = cases.traffic(mla)
    assert t["kv_bytes_per_token"] == 576 * 2 and t["kv"] == 64 * 4096 * 576 * 2
    assert t["q_kv_out"] == 64 * (16 * 576 * 2 + 16 * 512 * 2 + 576 * 2)  # Q, output, the new latent row
    assert cases.flops(mla) == 2 * (576 + 512) * 16 * 64 * 4096
    assert cases.traffic(cases.CASES["mla-fp8-b64-ctx4k-bs64"])["kv"] * 2 == t["kv"]


def test_inputs_are_valid_and_seeded(cases):
    import torch

    from pagedkit.validators import check_inputs

    for case in cases.DRY_CASES.values():
        x, attrs, outputs = cases.build_inputs(case, torch.device("cpu"), seed=3)
        assert check_inputs(x, attrs, outputs=outputs) == []
        assert x["attention_metadata"].tolist() == [case.query_len, max(case.contexts), 0]
        assert x["query"].shape[0] == case.batch * case.query_len
        assert x["past_seqlens"].tolist() == [c - case.query_len for c in case.contexts]
        table = x["block_table"]
        assert sorted(table[table >= 0].tolist()) != table[table >= 0].tolist()  # shuffled
        y, _, _ = cases.build_inputs(case, torch.device("cpu"), seed=3)
        assert all(torch.equal(x[k], y[k]) for k in x)  # same seed, same inputs
        copy = cases.arm_copy(x)
        assert copy["key_cache"].data_ptr() != x["key_cache"].data_ptr() and copy["query"] is x["query"]
        assert "attention_metadata" not in cases.build_inputs(case, torch.device("cpu"), metadata=False)[0]


def test_dry_run_writes_json_and_plot(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    data = json.loads((tmp_path / "attention.json").read_text())
    assert data["dry_run"] is True and data["bandwidth_tb_s"] == 4.4
    assert {"command", "date", "device", "versions", "settings", "rows"} <= set(data)
    assert {"torch", "triton", "onnxruntime"} <= set(data["versions"])
    assert [r["name"] for r in data["rows"]] == ["dry-fp16", "dry-int8-features", "dry-prefill", "dry-chunk",
                                                 "dry-mla"]
    for row in data["rows"]:
        assert "error" not in row, row.get("error")
        bytes_floor = row["bytes"]["total"] / 4.4e12 * 1e3
        if "flops" in row:  # prefill rows: the larger of the bandwidth and the compute floor
            assert row["floor_ms"] == pytest.approx(max(bytes_floor, row["flops"] / 790e12 * 1e3))
            assert row["arms"]["reference"]["tflop_s"] == pytest.approx(
                row["flops"] / row["arms"]["reference"]["ms"] / 1e9)
        else:
            assert row["floor_ms"] == pytest.approx(bytes_floor)
        for arm in ("torch_sdpa", "reference"):
            res = row["arms"][arm]
            assert res["ms"] > 0 and res["tb_s"] > 0
            assert res["fraction_of_floor"] == pytest.approx(row["floor_ms"] / res["ms"])
        assert row["parity"]["torch_sdpa_vs_reference"] < 2e-2
        assert row["ratios"]["torch_sdpa_speedup_vs_reference"] > 0
        triton = row["arms"]["triton"]
        assert ("ms" in triton) or set(triton) & {"skipped", "error"}
        if "ms" in triton:
            assert row["parity"]["triton_vs_reference"] < 2e-2
        mla = row["arms"]["triton_mla"]  # the fused MLA kernel serves the LATENT row only
        if row["name"] == "dry-mla":
            assert ("ms" in mla and row["parity"]["triton_mla_vs_reference"] < 2e-2) or "skipped" in mla, mla
        else:
            assert "skipped" in mla and "LATENT" in mla["skipped"], mla
        assert set(row["arms"]["ort"]) & {"skipped", "ms"}  # onnxruntime's CPU build has no PagedAttention
        routed = row["arms"]["sdpa_prefill"]  # first prompts only: the fused route of the plan hint "prefill"
        if row["name"] == "dry-prefill":
            assert "ms" in routed and routed["route"] == "math", routed
            assert row["parity"]["sdpa_prefill_vs_reference"] < 2e-2
        else:
            assert "skipped" in routed and "first prompts" in routed["skipped"], routed
        dense = row["arms"]["sdpa_flash"]
        if row["name"] == "dry-prefill":  # no cached prefix: torch's dense attention computes the same
            assert "ms" in dense, dense
            assert row["parity"]["triton_vs_sdpa_flash"] < 2e-2
        else:
            assert "skipped" in dense
    png = tmp_path / "attention_roofline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
