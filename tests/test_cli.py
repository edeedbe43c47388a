"""paged-validate: output format and exit status (0 clean, 1 issues, 2 unreadable / not ONNX)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import onnx
import pytest

from pagedkit.validators import validate_model
from pagedkit.validators.cli import main
from test_model_validation import EXAMPLE, drop_graph_output, example_model, relocate, save_external


def run_main(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def broken_model(tmp_path):
    """The example with two problems: a cache output that is not written back, a bad attribute."""
    m = example_model()
    drop_graph_output(m, "present.0.value")
    for a in m.graph.node:
        if a.op_type == "PagedAttention" and a.name == "layers.1.attn":
            for attr in a.attribute:
                if attr.name == "kv_num_heads":
                    attr.i = 3
    path = tmp_path / "broken.onnx"
    onnx.save(m, str(path))
    return path


def test_clean_model_prints_ok(capsys):
    assert run_main(capsys, EXAMPLE / "model.onnx") == (0, "OK: 2 attention nodes checked\n", "")
    assert run_main(capsys, EXAMPLE) == (0, "OK: 2 attention nodes checked\n", "")


def test_issues_one_line_each_and_exit_1(capsys, tmp_path):
    path = broken_model(tmp_path)
    expected = validate_model(path)
    assert len(expected) >= 2
    code, out, err = run_main(capsys, path)
    assert code == 1
    lines = out.splitlines()
    assert lines == [str(i) for i in expected]
    assert any("MODEL-cache-written-back" in line and "present.0.value" in line for line in lines)
    assert any("kv_num_heads" in line and line.startswith("layers.1.attn:") for line in lines)
    assert err.strip() == f"{len(expected)} issue(s) in {path} (2 attention nodes checked)"


def test_json_document(capsys, tmp_path):
    code, out, _ = run_main(capsys, broken_model(tmp_path), "--json")
    doc = json.loads(out)
    assert code == 1
    assert doc["summary"]["ok"] is False and doc["summary"]["attention_nodes"] == 2
    assert doc["summary"]["issues"] == len(doc["issues"]) >= 2
    for issue in doc["issues"]:
        assert {"node", "where", "rule", "expected", "got", "message", "text"} <= set(issue)
    code, out, _ = run_main(capsys, EXAMPLE, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["issues"] == [] and doc["summary"]["ok"] is True
    assert doc["summary"]["model"].endswith("model.onnx")


def test_external_data(capsys, tmp_path):
    path = save_external(example_model(), tmp_path / "ext")
    assert run_main(capsys, path)[0] == 0
    relocate(path, "../model.onnx.data")
    code, out, _ = run_main(capsys, path)
    assert code == 1 and "MODEL-external-data" in out and "'../model.onnx.data'" in out


@pytest.mark.parametrize("content", [None, b"", b"this is not an onnx model\n", bytes(range(256)) * 8])
def test_unreadable_exit_2(capsys, tmp_path, content):
    path = tmp_path / "model.onnx"
    if content is not None:
        path.write_bytes(content)
    code, out, err = run_main(capsys, path)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "Traceback" not in err


def test_folder_without_model_exit_2(capsys, tmp_path):
    code, _, err = run_main(capsys, tmp_path)
    assert code == 2 and "no such file" in err


def _cli() -> list[str]:
    exe = shutil.which("paged-validate")
    return [exe] if exe else [sys.executable, "-m", "pagedkit.validators.cli"]


def test_console_script(tmp_path):
    """The installed command, as the README runs it."""
    proc = subprocess.run([*_cli(), str(EXAMPLE / "model.onnx")], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "OK: 2 attention nodes checked\n"), proc.stderr
    bad = tmp_path / "bad.onnx"
    bad.write_text("not onnx")
    proc = subprocess.run([*_cli(), str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
