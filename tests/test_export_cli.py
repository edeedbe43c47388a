"""paged-export CLI and weight loading: local checkpoint folder end to end (quantized cache, summary), the
built-in names, random weights said loudly, refusals (pickle-only weights, remote code, unknown name),
--num-layers / --num-experts shrinking."""

from __future__ import annotations

import json

import pytest

from export_utils import assert_valid_export, save_tiny_checkpoint, tiny_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tiny_model("Qwen3Config", seed=21), tmp_path_factory.mktemp("qwen3") / "hf")


def test_cli_local_checkpoint_int8(ckpt, tmp_path, capsys):
    from pagedkit.exporters.cli import main
    from pagedkit.exporters.config import read_pagedkit_section

    out = tmp_path / "out"
    rc = main(["--model", str(ckpt), "--output", str(out), "--kv-cache", "int8", "--kv-quant", "PER_CHANNEL",
               "--num-layers", "1", "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "parameters:" in text and "file size:" in text and "KV cache per token:" in text and "SNR" in text
    # 1 layer, K and V int8: 2 * kv_heads (2) * head_size (16) bytes per token
    assert "KV cache per token:   64 bytes" in text
    assert_valid_export(out)
    section = read_pagedkit_section(out)
    assert len(section["layers"]) == 1 and section["layers"][0]["k_cache"] == {
        "dtype": "int8", "quant": "PER_CHANNEL", "rotation": False, "scale_dtype": None}
    assert section["source"]["weights"] == "safetensors"
    assert (out / "tokenizer.json").exists()


def test_cli_list(capsys):
    from pagedkit.exporters.cli import main

    assert main(["--list"]) == 0
    text = capsys.readouterr().out
    for name in ("deepseek-v2-lite", "deepseek-v3", "llama-3.1-8b", "mistral-7b", "qwen3-8b", "gemma-2-9b",
                 "gemma-3-4b", "gpt-oss-20b", "phi-3-mini"):
        assert name in text


def test_cli_rejects_mixed_cache_dtypes(ckpt, tmp_path):
    from pagedkit.exporters.cli import main

    with pytest.raises(SystemExit, match="share one dtype"):
        main(["--model", str(ckpt), "--output", str(tmp_path), "--k-cache", "int8", "--v-cache", "fp16"])


def test_pickle_only_checkpoint_refused(tmp_path):
    from pagedkit.exporters.weights import WeightsError, load_model

    tiny_model("LlamaConfig").config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(WeightsError, match="pickle"):
        load_model(tmp_path)


def test_remote_code_refused(tmp_path):
    from pagedkit.exporters.weights import WeightsError, load_model

    cfg = tiny_model("LlamaConfig").config.to_dict() | {"auto_map": {"AutoModelForCausalLM": "x.Y"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="trust_remote_code"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-transformers-model"}))
    with pytest.raises(WeightsError, match="trust_remote_code"):
        load_model(tmp_path)


def test_unknown_builtin_name():
    from pagedkit.exporters.weights import WeightsError, load_model

    with pytest.raises(WeightsError, match="built-in names"):
        load_model("llama-9000")


def test_config_only_folder_gives_random_weights_loudly(tmp_path, capsys):
    from pagedkit.exporters.weights import load_model

    tiny_model("LlamaConfig").config.to_json_file(tmp_path / "config.json")
    with pytest.warns(UserWarning, match="RANDOM weights"):
        loaded = load_model(tmp_path, num_layers=1)
    assert loaded.weights == "random" and loaded.config.num_hidden_layers == 1
    assert "RANDOM weights" in capsys.readouterr().err


def test_builtin_configs_shrink():
    """Every built-in config parses with transformers; --num-layers / --num-experts shrink it."""
    from pagedkit.exporters.weights import _config_from_dict, builtin_config, builtin_names, shrink_config

    for name in builtin_names():
        cfg = _config_from_dict(builtin_config(name), name)
        small = shrink_config(cfg, 2, 4 if name.startswith(("gpt-oss", "deepseek")) else None)
        assert small.num_hidden_layers == 2
        if getattr(small, "layer_types", None) is not None:
            assert len(small.layer_types) == 2
        if name == "gpt-oss-20b":
            assert small.num_local_experts == 4 and small.num_experts_per_tok == 4
        if name.startswith("deepseek"):
            assert small.n_routed_experts == 4 and small.num_experts_per_tok <= 4
