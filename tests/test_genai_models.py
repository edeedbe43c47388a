"""Models written by onnxruntime-genai's own builder validate clean (paged and GQA layouts), and the
whole-model rules catch broken variants of them.

Llama runs in CI (each build takes ~10 s on 2 cores); Qwen3, Gemma 2 and GPT-OSS are `slow`. A builder
failure outside our control (e.g. a transformers/onnxruntime-genai incompatibility) skips with the reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import onnx
import pytest
from onnx import helper, numpy_helper

from pagedkit.validators import validate_model
from pagedkit.validators.cli import main
from pagedkit.validators.model import check_model

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("transformers")

from genai_models import BuilderFailed, build_genai_model  # noqa: E402

OP = {"paged": "PagedAttention", "gqa": "GroupQueryAttention"}


@pytest.fixture(scope="session")
def genai_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("genai-models")


def built(root: Path, family: str, layout: str) -> Path:
    try:
        return build_genai_model(family, layout, root)
    except BuilderFailed as exc:
        pytest.skip(f"onnxruntime-genai builder could not build {family}/{layout}: {exc}")


def _assert_clean(folder: Path, layout: str, capsys) -> None:
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node if n.domain == "com.microsoft" and n.op_type in OP.values()]
    assert ops == [OP[layout]] * 2  # 2 layers, one attention node each
    assert (folder / "model.onnx.data").is_file()  # the builder writes external data
    report = check_model(folder)
    assert report.issues == [], [str(i) for i in report.issues]
    assert report.attention_nodes == 2
    assert main([str(folder / "model.onnx")]) == 0
    assert capsys.readouterr().out == "OK: 2 attention nodes checked\n"


@pytest.mark.parametrize("layout", ["paged", "gqa"])
def test_llama_builder_models_are_clean(genai_root, layout, capsys):
    _assert_clean(built(genai_root, "llama", layout), layout, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["paged", "gqa"])
@pytest.mark.parametrize("family", ["qwen3", "gemma2", "gpt_oss"])
def test_other_builder_models_are_clean(genai_root, family, layout, capsys):
    _assert_clean(built(genai_root, family, layout), layout, capsys)


# ------------------------------------------------------------------------------------------------
# broken variants of the builder's paged Llama (graph edited, external data kept)
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def paged_copy(genai_root, tmp_path):
    src = built(genai_root, "llama", "paged")
    dst = tmp_path / "llama-paged"
    shutil.copytree(src, dst)
    return dst, onnx.load(str(dst / "model.onnx"), load_external_data=False)


def _save(folder: Path, model: onnx.ModelProto) -> Path:
    onnx.save(model, str(folder / "model.onnx"))  # external-data references stay as they are
    return folder


def _attention(model):
    return [n for n in model.graph.node if n.op_type == "PagedAttention"]


def test_builder_model_cache_output_not_written_back(paged_copy):
    folder, m = paged_copy
    outputs = [o for o in m.graph.output if o.name != "present.1.value"]
    del m.graph.output[:]
    m.graph.output.extend(outputs)
    issues = [i for i in validate_model(_save(folder, m)) if i.rule == "MODEL-cache-written-back"]
    assert len(issues) == 1 and issues[0].where == "output 'value_cache_out'"
    assert issues[0].expected == "graph output 'present.1.value'" and "past_key_values.1.value" in issues[0].message


def test_builder_model_mismatched_layer_index(paged_copy):
    folder, m = paged_copy
    a0, a1 = _attention(m)
    a0.output[2], a1.output[2] = a1.output[2], a0.output[2]
    issues = [i for i in validate_model(_save(folder, m)) if i.rule == "MODEL-cache-output-name"]
    assert sorted((i.expected, i.got) for i in issues) == [("'present.0.value'", "'present.1.value'"),
                                                          ("'present.1.value'", "'present.0.value'")]


def test_builder_model_attention_metadata_from_a_node(paged_copy):
    folder, m = paged_copy
    inputs = [i for i in m.graph.input if i.name != "attention_metadata"]
    del m.graph.input[:]
    m.graph.input.extend(inputs)
    m.graph.node.insert(0, helper.make_node("Constant", [], ["attention_metadata"], name="metadata_const",
                                            value=numpy_helper.from_array(
                                                __import__("numpy").array([8, 256, 0], "int32"))))
    issues = [i for i in validate_model(_save(folder, m)) if i.rule == "MODEL-attention-metadata-graph-input"]
    assert len(issues) == 2 and all("metadata_const" in i.got for i in issues)


def test_builder_model_external_data_with_dotdot(paged_copy):
    folder, m = paged_copy
    (folder.parent / "model.onnx.data").write_bytes((folder / "model.onnx.data").read_bytes())
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = "../model.onnx.data"
    issues = validate_model(_save(folder, m))
    assert issues and all(i.rule == "MODEL-external-data" and i.got == "location '../model.onnx.data'"
                          for i in issues)
    assert main([str(folder)]) == 1
