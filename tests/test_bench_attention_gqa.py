"""benchmarks/attention_gqa.py without a GPU: the floor arithmetic of its rows, and the --dry-run plumbing (CPU,
tiny shapes, the triton_gqa arm through Triton's interpreter, onnxruntime's CPU GroupQueryAttention as the ort arm)
writing the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_modules import bench_module

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "attention_gqa.py"
DRY_ROWS = ["dry-decode-fp16", "dry-prefill-fp16"]


def test_rows_and_floor():
    with bench_module("attention_gqa") as mod:
        c = mod.CASES["gqa-decode-fp16-b16-ctx4k"]
        assert (c.batch, c.context, c.seq, c.num_heads, c.kv_heads, c.head_size) == (16, 4096, 1, 32, 8, 128)
        assert c.capacity > c.context  # a shared past / present buffer with headroom
        t = mod.traffic(c)
        assert t["kv"] == 16 * 4096 * 8 * 2 * 128 * 2
        assert t["q_kv_out"] == 16 * (2 * 32 * 128 + 2 * 8 * 128) * 2
        f = mod.floor_ms(c, 4.4, 790)
        assert f["floor_ms"] == pytest.approx(t["total"] / 4.4e12 * 1e3) and "flops" not in f
        assert mod.traffic(mod.CASES["gqa-decode-int8-b16-ctx4k"])["kv"] * 2 == t["kv"]
        assert mod.traffic(mod.CASES["gqa-decode-int4-b16-ctx4k"])["kv"] * 4 == t["kv"]
        pre = mod.CASES["gqa-prefill-fp16-b4-ctx4k"]
        assert pre.capacity == pre.context == pre.seq == 4096
        assert mod.flops(pre) == 4 * 4 * 32 * 128 * 4096 * 4097 // 2
        fp = mod.floor_ms(pre, 4.4, 790)
        assert fp["floor_ms"] == pytest.approx(max(fp["bandwidth_floor_ms"], mod.flops(pre) / 790e12 * 1e3))
        assert set(mod.QUICK) <= set(mod.CASES) and set(DRY_ROWS) <= set(mod.DRY_CASES)


def test_dry_run_times_both_arms(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--cases", *DRY_ROWS, "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    data = json.loads((tmp_path / "attention_gqa.json").read_text())
    assert {"command", "date", "device", "versions", "settings", "rows"} <= set(data)
    assert data["dry_run"] is True and data["bandwidth_tb_s"] == 4.4 and data["tflops"] == 790
    assert {"torch", "triton", "onnxruntime", "onnx", "python", "pagedkit_commit"} <= set(data["versions"])
    assert [r["name"] for r in data["rows"]] == DRY_ROWS
    for row in data["rows"]:
        assert "error" not in row, row["error"]
        assert row["bytes"]["total"] > 0 and row["floor_ms"] > 0
        if row["config"]["prefill"]:
            assert row["flops"] > 0 and row["floor_ms"] == pytest.approx(
                max(row["bandwidth_floor_ms"], row["compute_floor_ms"]))
        for arm in ("triton_gqa", "ort"):
            res = row["arms"][arm]
            assert res.get("ms", 0) > 0, (arm, res)
            assert res["fraction_of_floor"] == pytest.approx(row["floor_ms"] / res["ms"])
            assert res["tb_s"] > 0 and (("tflop_s" in res) == row["config"]["prefill"])
        assert row["arms"]["triton_gqa"]["eager_ms"] > 0 and row["arms"]["triton_gqa"]["present_in_place"]
        assert row["parity"]["triton_gqa_vs_ort"] < 2e-2
        assert row["ratios"]["triton_gqa_speedup_vs_ort"] > 0
        assert row["name"] in proc.stdout  # the one-line summary
