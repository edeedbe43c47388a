"""genai_config.json inputs that used to be accepted silently (issue 35 item 5): a config without a decoder
section, a field of the wrong type (`num_hidden_layers: "two"`), a block size the operator refuses
(`engine.dynamic_batching.block_size: 0`). One schema (pagedkit/validators/genai_schema.py GENAI_FIELDS) is
read by paged-validate / validate_model and by the runtime's reader (paged-run, Generator, Engine): each bad
field is refused in one line naming the field and its expected value, exit status 2 (paged-validate reports
a block size as the MODEL-block-size issue, exit 1), and the Python API raises ValueError with the same text.
Every row of the schema has a case here, so a row removed (or a check bypassed) fails a test.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
import shutil
from pathlib import Path

import pytest

from pagedkit.interface.genai_config import CacheSpec, LayerSpec, ModelSpec, genai_config
from pagedkit.apps.run.cli import main as run_main
from pagedkit.runtime.generate import read_config
from pagedkit.validators import validate_model
from pagedkit.validators.cli import main as validate_main
from pagedkit.validators.genai_schema import (
    BLOCK_SIZE_FIELDS, GENAI_FIELDS, GenaiConfigError, check_genai_config, config_problems, schema_markdown,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-paged"
BASE = json.loads((EXAMPLE / "genai_config.json").read_text())

# a value of the wrong type / range for each kind of row
BAD = {"object": 5, "section": "not json", "objects": [5], "string": 7, "int": "two", "ints": ["x"],
       "int or ints": "x", "names": {"input_ids": 5}, "template": "cache.%d.%d", "block size": 0}


def _put(cfg: dict, path: str, value) -> str:
    """Set `path` (a schema row's path; "[]" = the first item) in cfg; returns the field as reported."""
    keys, d, field = path.split("."), cfg, []
    for k in keys[:-1]:
        if k.endswith("[]"):
            d = d.setdefault(k[:-2], [{"layer": 0}])[0]
            field.append(f"{k[:-2]}[0]")
        else:
            d = d.setdefault(k, {})
            field.append(k)
    d[keys[-1]] = value
    return ".".join(field + [keys[-1]])


def _drop(cfg: dict, path: str) -> str:
    keys, d, field = path.split("."), cfg, []
    for k in keys[:-1]:
        d = d[k[:-2]][0] if k.endswith("[]") else d[k]
        field.append(f"{k[:-2]}[0]" if k.endswith("[]") else k)
    d.pop(keys[-1], None)
    return ".".join(field + [keys[-1]])


def _folder(tmp_path: Path, cfg: dict) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(EXAMPLE, folder)
    (folder / "genai_config.json").write_text(json.dumps(cfg))
    return folder


def _call(main, argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _error_line(text: str, prog: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    assert lines[0].startswith(f"{prog}: error: "), text
    return lines[0][len(f"{prog}: error: "):]


def _run(folder: Path) -> tuple[int, str, str]:
    return _call(run_main, [str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--ignore-eos"])


# ---------------------------------------------------------------------------------------------------------
# the three inputs of the issue
# ---------------------------------------------------------------------------------------------------------
def test_config_without_decoder_section(tmp_path):
    cfg = copy.deepcopy(BASE)
    del cfg["model"]["decoder"]
    folder = _folder(tmp_path, cfg)
    text = f"{folder / 'genai_config.json'}: model.decoder is missing: expected an object"
    rc, out, err = _call(validate_main, [str(folder)])
    assert rc == 2 and out == "" and _error_line(err, "paged-validate") == text
    with pytest.raises(ValueError) as exc:
        validate_model(folder)
    assert str(exc.value) == text and isinstance(exc.value, GenaiConfigError)
    rc, out, err = _run(folder)
    assert rc == 2 and _error_line(err, "paged-run") == text
    with pytest.raises(ValueError, match="^" + re.escape(text) + "$"):
        read_config(folder)


def test_num_hidden_layers_of_the_wrong_type(tmp_path):
    cfg = copy.deepcopy(BASE)
    cfg["model"]["decoder"]["num_hidden_layers"] = "two"
    folder = _folder(tmp_path, cfg)
    text = f"{folder / 'genai_config.json'}: model.decoder.num_hidden_layers must be an integer >= 1, got 'two'"
    rc, out, err = _call(validate_main, [str(folder)])
    assert rc == 2 and _error_line(err, "paged-validate") == text
    with pytest.raises(GenaiConfigError) as exc:
        validate_model(folder)
    assert str(exc.value) == text
    rc, out, err = _run(folder)
    assert rc == 2 and _error_line(err, "paged-run") == text
    with pytest.raises(ValueError) as exc:
        read_config(folder)
    assert str(exc.value) == text


def test_block_size_zero_in_the_config(tmp_path):
    cfg = copy.deepcopy(BASE)
    cfg["engine"]["dynamic_batching"]["block_size"] = 0
    folder = _folder(tmp_path, cfg)
    text = f"{folder / 'genai_config.json'}: engine.dynamic_batching.block_size must be a power of two >= 16, got 0"
    rc, out, err = _run(folder)
    assert rc == 2 and out == "" and _error_line(err, "paged-run") == text
    with pytest.raises(ValueError) as exc:
        read_config(folder)
    assert str(exc.value) == text
    # paged-validate reports it as the contract's MODEL-block-size issue (exit 1, one line naming the field)
    rc, out, err = _call(validate_main, [str(folder)])
    assert rc == 1 and out.splitlines() == [
        "genai_config.json: engine.dynamic_batching.block_size: block_size must be a power of two >= 16, got 0; "
        "expected a power of two >= 16, got 0 [MODEL-block-size]"]
    (issue,) = validate_model(folder)
    assert (issue.rule, issue.where, issue.expected) == ("MODEL-block-size", "engine.dynamic_batching.block_size",
                                                        "a power of two >= 16")


# ---------------------------------------------------------------------------------------------------------
# every row of the schema: a bad value is named, by both readers
# ---------------------------------------------------------------------------------------------------------
def test_every_kind_has_a_bad_value():
    assert {f.kind for f in GENAI_FIELDS} <= set(BAD)
    assert set(BLOCK_SIZE_FIELDS) == {"engine.dynamic_batching.block_size", "pagedkit.block_size"}


@pytest.mark.parametrize("row", GENAI_FIELDS, ids=[f.path for f in GENAI_FIELDS])
def test_each_field_is_checked(tmp_path, row):
    cfg = copy.deepcopy(BASE)
    field = _put(cfg, row.path, BAD[row.kind])
    (problem,) = config_problems(cfg)
    assert (problem.field, problem.expected) == (field, row.expected)
    line = f"{field} must be {row.expected}, got {BAD[row.kind]!r}"
    assert str(problem) == line
    folder = _folder(tmp_path, cfg)
    # (a file name that is no string is refused first by the path check, interface/paths.py, in its words)
    expect = f"{folder / 'genai_config.json'}: {field} 7 is a int, not a file name" if row.kind == "string" \
        else f"{folder / 'genai_config.json'}: {line}"
    rc, out, err = _run(folder)
    assert rc == 2 and expect in _error_line(err, "paged-run")
    rc, out, err = _call(validate_main, [str(folder)])
    if row.path in BLOCK_SIZE_FIELDS:
        assert rc == 1 and f"{field}: " in out and f"expected {row.expected}, got" in out, (out, err)
    else:
        assert rc == 2 and expect in _error_line(err, "paged-validate")


@pytest.mark.parametrize("row", [f for f in GENAI_FIELDS if f.required], ids=lambda f: f.path)
def test_required_fields(row):
    cfg = copy.deepcopy(BASE)
    if "[]" in row.path:
        cfg["pagedkit"] = {"layers": [{"layer": 0, "head_size": 16}]}
    field = _drop(cfg, row.path)
    runtime = config_problems(cfg, runtime=True)
    assert [(p.field, str(p)) for p in runtime] == [(field, f"{field} is missing: expected {row.expected}")]
    assert config_problems(cfg) == ([] if row.required == "runtime" else runtime)


def test_all_problems_at_once_on_one_line(tmp_path):
    cfg = copy.deepcopy(BASE)
    cfg["model"]["decoder"]["num_hidden_layers"] = "two"
    cfg["model"]["decoder"]["head_size"] = -1
    cfg["search"]["max_length"] = 1.5
    with pytest.raises(GenaiConfigError) as exc:
        check_genai_config(cfg, "cfg.json")
    assert str(exc.value) == ("cfg.json: model.decoder.num_hidden_layers must be an integer >= 1, got 'two'; "
                              "model.decoder.head_size must be an integer >= 1, got -1; "
                              "search.max_length must be an integer >= 1, got 1.5")
    assert len(exc.value.problems) == 3
    rc, out, err = _call(validate_main, [str(_folder(tmp_path, cfg))])
    assert rc == 2 and _error_line(err, "paged-validate").count(" must be ") == 3


def test_huge_and_odd_values_stay_one_short_line():
    cfg = copy.deepcopy(BASE)
    cfg["model"]["vocab_size"] = 10 ** 30
    cfg["model"]["decoder"]["inputs"]["past_key_names"] = "x" * 500
    cfg["model"]["eos_token_id"] = [[1]]
    text = "; ".join(map(str, config_problems(cfg)))
    assert "\n" not in text and len(text) < 400, text
    assert [p.field for p in config_problems(cfg)] == [
        "model.decoder.inputs.past_key_names", "model.vocab_size", "model.eos_token_id"]


def test_rewrite_refuses_a_bad_source_config(tmp_path):
    from pagedkit.rewriters.cli import main as rewrite_main

    cfg = copy.deepcopy(BASE)
    cfg["model"]["decoder"]["num_hidden_layers"] = "two"
    folder = _folder(tmp_path, cfg)
    out = tmp_path / "out" / "model.onnx"
    rc, _, err = _call(rewrite_main, [str(folder), str(out), "--to", "gqa"])
    assert rc == 2 and _error_line(err, "paged-rewrite") == (
        f"{folder / 'genai_config.json'}: model.decoder.num_hidden_layers must be an integer >= 1, got 'two'")
    assert not out.exists()  # refused before anything is written


# ---------------------------------------------------------------------------------------------------------
# good configs still pass
# ---------------------------------------------------------------------------------------------------------
def test_good_configs_pass(tmp_path):
    assert config_problems(BASE, runtime=True) == []
    rc, out, err = _call(validate_main, [str(EXAMPLE)])
    assert rc == 0 and out.startswith("OK: "), (out, err)
    assert read_config(EXAMPLE).num_layers == 2
    # what pagedkit's writer produces: sliding window, PER_TOKEN scale caches, the pagedkit section as JSON text
    per_token = CacheSpec(dtype="int8", quant="PER_TOKEN", scale_dtype="float16")
    layers = [LayerSpec(0, 4, 2, 16, k_cache=per_token, v_cache=per_token),
              LayerSpec(1, 4, 2, 16, window=32, windowed_table=True)]
    spec = ModelSpec("llama", 128, 64, 4, 2, 16, 256, layers, eos_token_id=[2, 3])
    written = genai_config(spec)
    assert isinstance(written["pagedkit"], str)
    assert config_problems(written, runtime=True) == []
    assert config_problems(written | {"pagedkit": json.loads(written["pagedkit"])}, runtime=True) == []
    # a partial config given to validate_model names only what it overrides
    assert config_problems({"model": {"decoder": {"inputs": {"past_key_names": "k.%d"}}}}) == []
    # null is "absent"
    nulls = copy.deepcopy(BASE)
    nulls["model"]["vocab_size"] = None
    nulls["engine"]["dynamic_batching"]["block_size"] = None
    assert config_problems(nulls, runtime=True) == []


def test_onnxruntime_genai_gqa_config_passes():
    from pagedkit.rewriters.paged_to_gqa import gqa_genai_config

    assert config_problems(gqa_genai_config(BASE), runtime=True) == []


# ---------------------------------------------------------------------------------------------------------
# the docs show the schema as it is
# ---------------------------------------------------------------------------------------------------------
def test_validate_docs_list_the_schema():
    doc = (ROOT / "docs" / "validate.md").read_text()
    assert schema_markdown() in doc, "docs/validate.md: paste genai_schema.schema_markdown() into it"
    assert "model.decoder.num_hidden_layers must be an integer >= 1, got 'two'" in doc
