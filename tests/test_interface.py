"""pagedkit.interface: the genai I/O names, genai_config.json round trip, the dtype table."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from pagedkit.interface import dtypes, names as N
from pagedkit.interface.genai_config import (
    CacheSpec, LayerSpec, ModelSpec, cache_templates, genai_config, read_genai_config, read_pagedkit_section,
    with_decoded_pagedkit, write_genai_config,
)
from pagedkit.validators.contract import CACHE_FORMATS, get_contract


# ---- names ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", N.CACHE_KINDS)
@pytest.mark.parametrize("layer", [0, 7, 123])
def test_cache_names_round_trip(kind, layer):
    past, present = N.past_name(kind, layer), N.present_name(kind, layer)
    assert past == f"past_key_values.{layer}.{kind}" and present == f"present.{layer}.{kind}"
    assert N.layer_of(past, N.PAST_TEMPLATES[kind]) == layer
    assert N.layer_of(present, N.PRESENT_TEMPLATES[kind]) == layer
    assert N.layer_name(N.PAST_TEMPLATES[kind], layer) == past


def test_layer_of_rejects_other_names():
    assert N.layer_of("past_key_values.1.value", N.PAST_KEY) is None
    assert N.layer_of("past_key_values.x.key", N.PAST_KEY) is None
    assert N.layer_of("past_key_values.1.key_scale", N.PAST_KEY) is None  # fullmatch
    assert N.layer_of("cache[3]k", "cache[%d]k") == 3  # regex characters in a custom template are literal


@pytest.mark.parametrize("bad", ["past_key_values.{i}.key", "past.key", "a.%d.%d", None])
def test_templates_need_exactly_one_layer_placeholder(bad):
    assert N.template_error(bad)
    with pytest.raises(ValueError, match="exactly one '%d'"):
        N.check_template(bad)


def test_genai_config_keys_of_cache_templates():
    assert [N.past_names_key(k) for k in N.CACHE_KINDS] == [
        "past_key_names", "past_value_names", "past_key_scale_names", "past_value_scale_names"]
    assert N.present_names_key("value_scale") == "present_value_scale_names"
    with pytest.raises(ValueError):
        N.past_names_key("keys")


def test_extension_inputs_are_contract_inputs():
    """The whole-model extension inputs carry the PagedAttention input names they feed (§8)."""
    c = get_contract("PagedAttention")
    for name in N.EXTENSION_INPUTS + (N.ATTENTION_METADATA,):
        c.input_index(name)


# ---- genai_config.json ---------------------------------------------------------------------------------

def _spec(per_token: bool = True, windowed: bool = True, latent: bool = False) -> ModelSpec:
    quant = "PER_TOKEN" if per_token else "NONE"
    layers = []
    for i in range(3):
        k = CacheSpec("int4" if per_token else "float16", quant, rotation=per_token,
                      scale_dtype="float16" if per_token else None)
        v = None if latent else CacheSpec("int8" if per_token else "float16", quant,
                                          scale_dtype="float16" if per_token else None)
        w = 8 if windowed and i % 2 == 0 else -1
        layers.append(LayerSpec(i, 4, 1 if latent else 2, 64, window=w, windowed_table=w > 0,
                                layout="LATENT" if latent else "SEPARATE", k_cache=k, v_cache=v))
    return ModelSpec("llama", 100, 256, 4, 2, 64, 512, layers, block_size=32, eos_token_id=[1, 2],
                     slot_mapping=None if windowed else N.SLOT_MAPPING, query_positions=N.QUERY_POSITIONS,
                     rope={"rope_theta": 10000.0}, source={"model": "x"})


@pytest.mark.parametrize("per_token,windowed,latent", [(True, True, False), (False, False, False),
                                                       (False, False, True)])
def test_genai_config_round_trip(tmp_path, per_token, windowed, latent):
    spec = _spec(per_token, windowed, latent)
    path = write_genai_config(tmp_path, spec)
    assert path == tmp_path / "genai_config.json"
    cfg = read_genai_config(tmp_path)
    assert cfg == read_genai_config(path) == json.loads(json.dumps(genai_config(spec)))
    assert isinstance(cfg["pagedkit"], str)  # a JSON string: onnxruntime-genai rejects unknown objects
    section = read_pagedkit_section(tmp_path)
    assert section == read_pagedkit_section(cfg) == with_decoded_pagedkit(cfg)["pagedkit"]
    assert section["block_size"] == 32 and section["inputs"].get("query_positions") == "query_positions"
    # every layer's spec comes back
    for l, d in zip(spec.layers, section["layers"]):
        assert (d["layer"], d["window"], d["layout"], d["head_size"]) == (l.layer, l.window, l.layout, l.head_size)
        assert CacheSpec(**d["k_cache"]) == l.k_cache
        assert (CacheSpec(**d["v_cache"]) if d["v_cache"] else None) == l.v_cache
        assert d["block_table"] == (N.BLOCK_TABLE_WINDOWED if l.windowed_table else N.BLOCK_TABLE)
    dec = cfg["model"]["decoder"]
    assert dec["inputs"]["past_key_names"] == "past_key_values.%d.key"
    assert ("past_value_names" in dec["inputs"]) == (not latent)
    assert ("past_key_scale_names" in dec["inputs"]) == per_token
    assert (N.BLOCK_TABLE_WINDOWED in dec["inputs"]) == windowed
    assert dec["state_groups"] == [{"kind": "paged_kv", "layer_ids": [0, 1, 2]}]
    # the reader every layer uses gives the writer's templates back
    t = cache_templates(cfg)
    assert t == {k: (N.PAST_TEMPLATES[k], N.PRESENT_TEMPLATES[k]) for k in N.CACHE_KINDS}


def test_cache_templates_follow_the_config_and_derive_scale_names():
    cfg = {"model": {"decoder": {"inputs": {"past_key_names": "k.%d", "past_value_names": "v.%d"},
                                 "outputs": {"present_key_names": "pk.%d"}}}}
    t = cache_templates(cfg)
    assert t["key"] == ("k.%d", "pk.%d") and t["value"] == ("v.%d", "present.%d.value")
    assert t["key_scale"] == ("k.%d_scale", "pk.%d_scale")
    assert cache_templates(None) == cache_templates({}) == cache_templates({"pagedkit": "not json"})


def test_read_pagedkit_section_without_or_with_bad_section():
    assert read_pagedkit_section(None) == {} and read_pagedkit_section({"model": {}}) == {}
    assert read_pagedkit_section({"pagedkit": {"block_size": 16}}) == {"block_size": 16}
    with pytest.raises(ValueError, match="'pagedkit' must be an object"):
        read_pagedkit_section({"pagedkit": "[1, 2]"})


def test_exporters_config_is_the_interface():
    from pagedkit import exporters
    from pagedkit.exporters import config

    assert config.ModelSpec is exporters.ModelSpec is ModelSpec
    assert config.read_pagedkit_section is read_pagedkit_section and config.PAST_KEY == N.PAST_KEY


# ---- dtypes --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("row", dtypes.ELEM_TYPES, ids=lambda r: r.name)
def test_dtype_table_matches_onnx(row):
    assert row.name == helper.tensor_dtype_to_string(row.elem).replace("TensorProto.", "").lower()
    assert dtypes.numpy_dtype(row.elem) == helper.tensor_dtype_to_np_dtype(row.elem)
    assert dtypes.elem_type_of_numpy(dtypes.numpy_dtype(row.elem)) == row.elem
    assert dtypes.elem_type(dtypes.type_str(row.elem)) == row.elem == dtypes.elem_type(row.numpy)
    t = dtypes.torch_dtype(row.elem)
    assert str(t) == f"torch.{row.torch}" and dtypes.elem_type_of_torch(t) == row.elem
    assert dtypes.numpy_dtype(row.elem).itemsize == t.itemsize


def test_type_strings_as_onnxruntime_prints_them():
    assert dtypes.type_str(TensorProto.FLOAT) == "tensor(float)"
    assert dtypes.type_str(TensorProto.FLOAT16) == "tensor(float16)"
    assert dtypes.type_str(TensorProto.FLOAT8E4M3FN) == "tensor(float8e4m3fn)"
    assert dtypes.type_name(None) == "unknown" and dtypes.type_name(TensorProto.STRING) == "string"
    assert dtypes.elem_type("float32") == dtypes.elem_type("tensor(float)") == TensorProto.FLOAT
    with pytest.raises(KeyError):
        dtypes.elem_type("tensor(float3)")


def test_type_strings_of_onnxruntime_schemas():
    """Every type string our contracts and onnxruntime's schema use reads back to its element type."""
    for op in ("PagedAttention", "GroupQueryAttention"):
        for types in get_contract(op).type_constraints.values():
            for t in types:
                assert dtypes.type_str(dtypes.elem_type(t)) == t


def test_cache_formats_have_dtypes():
    """Cache storage dtypes come from the contract's cache-format table through this module."""
    want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
            "float8e4m3fn": torch.float8_e4m3fn, "int4": torch.uint8}
    assert {n: dtypes.torch_dtype(f.storage) for n, f in CACHE_FORMATS.items()} == want


@pytest.mark.parametrize("elem", [TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2,
                                  TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL])
def test_numpy_torch_round_trip(elem):
    x = np.array([[0.5, -1.0, 2.0], [0.0, 3.0, -0.25]], dtype=np.float32).astype(dtypes.numpy_dtype(elem))
    t = dtypes.torch_from_numpy(x)
    assert t.dtype == dtypes.torch_dtype(elem) and tuple(t.shape) == x.shape
    assert np.array_equal(t.float().numpy(), x.astype(np.float32))
    back = dtypes.numpy_from_torch(t)
    assert back.dtype == x.dtype and back.tobytes() == x.tobytes()
    assert not np.shares_memory(dtypes.numpy_from_torch(dtypes.torch_from_numpy(x)), x)  # copy by default


def test_runtime_and_validator_tables_are_the_one_table():
    from pagedkit.runtime.ops.util import ONNX_TO_TORCH as ops_table
    from pagedkit.runtime.tensors import ONNX_TO_TORCH, TORCH_TO_ONNX
    from pagedkit.validators.nodeview import dtype_from_type_str, onnx_dtype_of, type_str

    assert ONNX_TO_TORCH is ops_table is dtypes.onnx_to_torch() and TORCH_TO_ONNX is dtypes.torch_to_onnx()
    assert type_str(TensorProto.BFLOAT16) == "tensor(bfloat16)" and dtype_from_type_str("tensor(int32)") == 6
    assert onnx_dtype_of(torch.zeros(1, dtype=torch.float8_e4m3fn)) == TensorProto.FLOAT8E4M3FN
    assert onnx_dtype_of(np.zeros(1, np.int32)) == TensorProto.INT32
    assert onnx.TensorProto.UNDEFINED == onnx_dtype_of(np.array(["a"]))
