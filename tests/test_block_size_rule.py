"""One block-size rule everywhere (contract.block_size_error: a power of two >= 16, as onnxruntime): every
entry point refuses a bad block size at once, before any loading or writing, with the contract's own text."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkit.validators.contract import BLOCK_SIZE_RULE, MIN_BLOCK_SIZE, block_size_error

ROOT = Path(__file__).resolve().parents[1]
TINY_PAGED = ROOT / "examples" / "tiny-paged"
BAD = (8, 0, 24, -16, 12, 1)


def test_the_rule():
    assert MIN_BLOCK_SIZE == 16 and BLOCK_SIZE_RULE == "block_size must be a power of two >= 16"
    for ok in (16, 32, 64, 128, 256, 1024):
        assert block_size_error(ok) is None
    assert block_size_error(8) == "block_size must be a power of two >= 16, got 8"
    for bad in (*BAD, 48, 16.0, True, "16", None):
        assert block_size_error(bad).startswith(BLOCK_SIZE_RULE + ", got "), bad


def _no_loading(monkeypatch):
    """Any model loading or exporting after this point fails the test: the refusal must come first."""
    import pagedkit.exporters.export as export_mod

    def boom(*a, **k):
        raise AssertionError("work started before the block size was checked")

    monkeypatch.setattr(export_mod, "load_model", boom)
    monkeypatch.setattr(export_mod, "_export", boom)


@pytest.mark.parametrize("bs", BAD)
def test_paged_export_refuses_at_once(bs, tmp_path, capsys, monkeypatch):
    from pagedkit.exporters.cli import main

    _no_loading(monkeypatch)
    out = tmp_path / "out"
    assert main(["--model", "llama-3.1-8b", "--output", str(out), f"--block-size={bs}", "--quiet"]) == 2
    cap = capsys.readouterr()
    assert cap.err.splitlines() == [f"paged-export: error: --block-size: {block_size_error(bs)}"]
    assert cap.out == "" and not out.exists()


def test_paged_export_process_exit_status_and_one_line(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pagedkit.exporters.cli", "--model", "llama-3.1-8b", "--output",
                           str(out), "--block-size", "8"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["paged-export: error: --block-size: " + block_size_error(8)]
    assert not out.exists()


@pytest.mark.parametrize("bs", (8, 24, 0))
def test_python_export_api_refuses_before_loading(bs, tmp_path, monkeypatch):
    from pagedkit.exporters.export import build_model, export, export_hf_model
    from pagedkit.exporters.families.base import ExportOptions

    _no_loading(monkeypatch)
    msg = block_size_error(bs)
    with pytest.raises(ValueError, match=msg):
        export("llama-3.1-8b", tmp_path / "out", ExportOptions(block_size=bs, progress=False), num_layers=1)
    with pytest.raises(ValueError, match=msg):
        build_model(object(), ExportOptions(block_size=bs))  # refused before the model is even looked at
    monkeypatch.undo()
    with pytest.raises(ValueError, match=msg):
        export_hf_model(object(), tmp_path / "out", ExportOptions(block_size=bs))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bs", (0, -16, 8, 24))
def test_paged_run_refuses_block_size(bs, capsys):
    from pagedkit.apps.run.cli import main

    assert main([str(TINY_PAGED), "--prompt-ids", "1,2", f"--block-size={bs}"]) == 2
    cap = capsys.readouterr()
    assert cap.err.splitlines() == [f"paged-run: --block-size: {block_size_error(bs)}"]
    assert cap.out == ""  # refused before the model was loaded


def test_generator_option():
    from pagedkit.runtime.generate import Generator

    for bs in (0, 8, -16):
        with pytest.raises(ValueError, match=block_size_error(bs)):
            Generator(TINY_PAGED, block_size=bs)
    gen = Generator(TINY_PAGED, block_size=16)  # the model's caches are [num_blocks, 16, ...]
    assert gen.state.mgr.config.groups[0].block_size == 16
    assert len([s.token for s in gen.greedy([1, 7, 9, 30], 2)]) == 2
    # a valid block size the graph's static cache shape contradicts is refused at construction, by name
    with pytest.raises(ValueError, match=r"block_size 32: the model's caches fix block_size 16 .*past_key_values\.0\.key"):
        Generator(TINY_PAGED, block_size=32)


@pytest.mark.parametrize("bs", (8, 4, 12, 0))
def test_kv_cache_config_refuses(bs):
    from pagedkit.runtime.kv.cache import KVCacheManager
    from pagedkit.runtime.kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec

    group = GroupConfig("full", 8, bs, (LayerCacheSpec(0, 2, 16),))
    assert group.check() == [f"group 'full': {block_size_error(bs)}"]
    cfg = KVCacheConfig((group,), max_batch_size=1, max_num_tokens=16, max_seq_len=64)
    assert f"group 'full': {block_size_error(bs)}" in cfg.check()
    with pytest.raises(ValueError, match=block_size_error(bs)):
        KVCacheManager(cfg)
    ok = GroupConfig("full", 8, 16, (LayerCacheSpec(0, 2, 16),))
    assert ok.check() == []


def test_validator_rule_uses_the_contract_text():
    from nodes import make_paged_case

    from pagedkit.validators import validate_node

    for bs, bad in ((8, True), (24, True), (16, False), (32, False)):
        node, value_info = make_paged_case(num_heads=4, kv_num_heads=2, head_size=16, block_size=bs,
                                           past=(0, 3), q_lens=(2, 1)).node()
        hits = [i for i in validate_node(node, value_info) if i.rule == "PA-block-size"]
        if bad:
            assert len(hits) == 1 and hits[0].where == "input 'key_cache'"
            assert hits[0].message == f"Input 'key_cache' dimension 1: {block_size_error(bs)}"
            assert hits[0].expected == "a power of two >= 16"
        else:
            assert hits == []


def test_validate_model_checks_the_configured_block_size(tmp_path):
    from pagedkit.validators import validate_model

    model = tmp_path / "tiny"
    shutil.copytree(TINY_PAGED, model)
    assert validate_model(model) == []
    cfg = json.loads((model / "genai_config.json").read_text())
    cfg["engine"]["dynamic_batching"]["block_size"] = 8
    cfg["pagedkit"] = json.dumps({"block_size": 24})  # pagedkit's writer stores its section as JSON text
    (model / "genai_config.json").write_text(json.dumps(cfg))
    issues = [i for i in validate_model(model) if i.rule == "MODEL-block-size"]
    assert {(i.where, i.message) for i in issues} == {
        ("engine.dynamic_batching.block_size", block_size_error(8)),
        ("pagedkit.block_size", block_size_error(24))}
