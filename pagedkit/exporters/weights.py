"""Load the Hugging Face model an export starts from: local safetensors, a local GGUF file, or random
weights from a config (built-in or local) — never the network, never pickle, never remote code.

`NAME_OR_PATH` is
- a local checkpoint folder (config.json + *.safetensors): loaded with `use_safetensors=True`;
- a local `.gguf` file (or a folder holding exactly one): loaded by transformers (`gguf_file=`);
- a built-in name (`builtin_names()`): the config shipped in `pagedkit/exporters/builtin/NAME.json`, with
  the weights of its Hugging Face repo when they are already in the local HF cache (`HF_HOME`), else
  random weights, said loudly;
- a local folder with only config.json: random weights, said loudly.
A checkpoint whose weights are only pickles (.bin / .pt / .pth / .ckpt) or that needs
`trust_remote_code` (an `auto_map` in its config, or a model type transformers does not know) is
refused with a message that says why.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import settings

settings.stay_offline("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")  # pagedkit never touches the network

BUILTIN_DIR = Path(__file__).with_name("builtin")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
# config keys that count experts, and the matching top-k key (shrunk together by num_experts)
_EXPERT_KEYS = (("num_local_experts", "num_experts_per_tok"), ("n_routed_experts", "num_experts_per_tok"),
                ("num_experts", "num_experts_per_tok"))


class RandomWeightsWarning(UserWarning):
    """Exporting random weights (no local checkpoint weights). The banner on stderr is what the user
    reads; the warning is for code (pytest.warns, filters) and is not displayed by default, so that the
    message is printed once. An explicit filter (-W always, simplefilter) still shows it."""


warnings.filterwarnings("ignore", category=RandomWeightsWarning, append=True)  # after any user filter


class WeightsError(ValueError):
    """A checkpoint pagedkit refuses to load (pickle, remote code, nothing usable); the message says why."""


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM in eval mode, eager attention
    config: object  # its PretrainedConfig
    name: str  # what the user asked for
    weights: str  # "safetensors" | "gguf" | "random"
    source_dir: Path | None  # where tokenizer files may be found
    checkpoint: Path | None = None  # the local weights loaded (checkpoint folder or .gguf file); None: random


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def builtin_config(name: str) -> dict:
    path = BUILTIN_DIR / f"{name}.json"
    if not path.exists():
        raise WeightsError(f"unknown built-in model {name!r}; built-in names: {', '.join(builtin_names())}")
    return json.loads(path.read_text(encoding="utf-8"))


def _refuse_remote_code(cfg: dict, where: str) -> None:
    from transformers import CONFIG_MAPPING

    if cfg.get("auto_map"):
        raise WeightsError(f"{where}: the config has an 'auto_map' (custom modelling code); pagedkit never "
                           "runs trust_remote_code. Use a checkpoint of a model type transformers ships.")
    model_type = cfg.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise WeightsError(f"{where}: model_type {model_type!r} is not built into transformers; loading it would "
                           "need trust_remote_code, which pagedkit never uses.")


def shrink_config(config, num_layers: int | None = None, num_experts: int | None = None):
    """A copy of `config` with fewer layers (layer_types cut to match) and/or fewer routed experts (in its text
    part for a multimodal config without num_hidden_layers of its own: Llama 4's `llama4`)."""
    config = copy.deepcopy(config)
    text = config if hasattr(config, "num_hidden_layers") else config.get_text_config()
    if num_layers is not None:
        if num_layers < 1 or num_layers > text.num_hidden_layers:
            raise ValueError(f"--num-layers must be in [1, {text.num_hidden_layers}], got {num_layers}")
        text.num_hidden_layers = num_layers
        if getattr(text, "layer_types", None) is not None:
            text.layer_types = list(text.layer_types[:num_layers])
    if num_experts is not None:
        for key, topk in _EXPERT_KEYS:
            if getattr(text, key, None):
                setattr(text, key, num_experts)
                if getattr(text, topk, 0) > num_experts:
                    setattr(text, topk, num_experts)
                _shrink_groups(text, num_experts, topk)
                break
        else:
            raise ValueError("--num-experts: this model has no routed experts")
    return config


def _shrink_groups(config, num_experts: int, topk_key: str) -> None:
    """Group-limited routing (DeepSeek V2 / V3: n_group groups, topk_group kept) on fewer experts: groups keep
    at least 2 experts each (V3 ranks a group by its top-2 scores) and divide the experts, topk_group shrinks
    in proportion, and top-k stays within the experts of the kept groups."""
    n_group = int(getattr(config, "n_group", 0) or 0)
    if n_group <= 1:
        return
    new = n_group
    while new > 1 and (num_experts % new or num_experts // new < 2):
        new -= 1
    kept = max(1, int(getattr(config, "topk_group", new) or new) * new // n_group)
    config.n_group, config.topk_group = new, min(kept, new)
    cap = config.topk_group * (num_experts // new)
    if getattr(config, topk_key, 0) > cap:
        setattr(config, topk_key, cap)


def _config_from_dict(cfg: dict, where: str):
    from transformers import AutoConfig

    _refuse_remote_code(cfg, where)
    cfg = {k: v for k, v in cfg.items() if k not in ("transformers_version",)}
    return AutoConfig.for_model(**cfg)


def _hf_cache_snapshot(repo: str | None) -> Path | None:
    """The local snapshot folder of `repo` in the HF cache, when its weights are there (offline)."""
    if not repo:
        return None
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo, local_files_only=True))
    except Exception:  # not cached (or hub library missing): no local weights
        return None
    return path if any(path.glob("*.safetensors")) else None


def _random_model(config, name: str, dtype: torch.dtype, seed: int, why: str, stream: bool = False) -> LoadedModel:
    """Random weights drawn as the model's own init draws them (random_weights.py): lazy (drawn when the export
    writes each tensor, in parallel blocks) when `stream`, else materialized, both the same values for a seed.
    A model whose init cannot be recorded is built eagerly with from_config (its values then follow torch's
    global generator seeded with `seed`)."""
    from transformers import AutoModelForCausalLM

    from .random_weights import RandomInitUnsupported, lazy_random_model, materialized_random_model

    msg = (f"no local weights for {name!r} ({why}): exporting RANDOM weights built from its config. "
           "The model will produce noise; point --model at a local checkpoint folder for real weights.")
    banner = "!" * 100
    print(f"{banner}\nWARNING: {msg}\n{banner}", file=sys.stderr)
    warnings.warn(msg, RandomWeightsWarning, stacklevel=3)
    config._attn_implementation = "eager"
    try:
        model = (lazy_random_model if stream else materialized_random_model)(config, dtype, seed)
    except RandomInitUnsupported as exc:
        warnings.warn(f"{name}: random weights drawn eagerly by from_config ({exc})", stacklevel=3)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return LoadedModel(model.eval(), model.config, name, "random", None)


def _from_dir(path: Path, name: str, config, dtype: torch.dtype, stream: bool = True) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    if stream:  # a meta-device model whose weights read themselves from the files when written
        from .checkpoint import STREAMED_QUANT_METHODS, streamed_model

        qcfg = getattr(config, "quantization_config", None) or {}
        method = str((qcfg if isinstance(qcfg, dict) else qcfg.to_dict()).get("quant_method", "")).lower()
        if not method or method in STREAMED_QUANT_METHODS:
            model = streamed_model(path, config, dtype)
            return LoadedModel(model, model.config, name, "safetensors", path, Path(path).resolve())
        warnings.warn(f"{path}: {method} checkpoints are not read tensor by tensor; loading the whole model with "
                      "from_pretrained (transformers dequantizes it)", stacklevel=3)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, torch_dtype=dtype, use_safetensors=True, trust_remote_code=False,
        local_files_only=True, attn_implementation="eager")
    return LoadedModel(model.eval(), model.config, name, "safetensors", path, Path(path).resolve())


def _from_gguf(file: Path, name: str, dtype: torch.dtype, num_layers: int | None) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise WeightsError(f"{file}: reading GGUF needs the 'gguf' package (pip install gguf)") from exc
    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name, local_files_only=True)
    _refuse_remote_code(config.to_dict(), str(file))
    config = shrink_config(config, num_layers)
    model = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, config=config, torch_dtype=dtype, trust_remote_code=False,
        local_files_only=True, attn_implementation="eager")
    return LoadedModel(model.eval(), model.config, name, "gguf", file.parent, file.resolve())


def load_model(name_or_path: str | os.PathLike, *, num_layers: int | None = None, num_experts: int | None = None,
               dtype: torch.dtype = torch.float32, seed: int = 0, stream: bool = False) -> LoadedModel:
    """The HF model an export starts from (see the module doc). Never touches the network. stream: a
    safetensors checkpoint becomes a meta-device model whose parameters are lazy readers of its files
    (checkpoint.streamed_model: nothing is read until the export writes each weight), and random weights one
    whose parameters are drawn when written (random_weights.py; the same values as stream=False gives for the
    seed); GGUF files are loaded in memory either way."""
    name = str(name_or_path)
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path, name, dtype, num_layers)
    if path.is_file():
        raise WeightsError(f"{path}: expected a checkpoint folder (config.json + *.safetensors) or a .gguf file")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists():
            if len(ggufs) == 1:
                return _from_gguf(ggufs[0], name, dtype, num_layers)
            raise WeightsError(f"{path}: no config.json (and not exactly one .gguf file) in this folder")
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
        config = shrink_config(_config_from_dict(cfg, str(path)), num_layers, num_experts)
        if any(path.glob("*.safetensors")):
            return _from_dir(path, name, config, dtype, stream)
        pickles = [p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        if pickles:
            raise WeightsError(f"{path}: only pickle weights ({', '.join(sorted(pickles)[:3])}); pagedkit loads "
                               "safetensors or GGUF only (pickles can run code). Convert them to safetensors first.")
        loaded = _random_model(config, name, dtype, 0 if seed is None else seed, "the folder has no *.safetensors",
                               stream)
        loaded.source_dir = path
        return loaded
    from .fetch import FETCHABLE, fetched, model_folder

    if name in FETCHABLE:  # a model `paged-fetch NAME` put in the cache folder (never fetched from here)
        got = fetched(name)
        if got is None:
            raise WeightsError(f"{name} is not fetched yet: run `paged-fetch {name}` first (it fills "
                               f"{model_folder(name)}; paged-export itself never downloads)")
        return _from_gguf(got.gguf, name, dtype, num_layers)
    if os.sep in name or name.startswith("."):
        raise WeightsError(f"{name}: no such file or folder")
    cfg = builtin_config(name)
    repo = cfg.get("_name_or_path")
    config = shrink_config(_config_from_dict(cfg, f"built-in {name}"), num_layers, num_experts)
    snapshot = _hf_cache_snapshot(repo)
    if snapshot is not None:
        return _from_dir(snapshot, name, config, dtype, stream)
    return _random_model(config, name, dtype, seed, f"{repo or 'its repo'} is not in the local HF cache", stream)


def copy_tokenizer_files(source_dir: Path | None, out_dir: Path) -> list[str]:
    """Copy the tokenizer files found in `source_dir` (if any) to `out_dir`; returns their names."""
    copied = []
    if source_dir is None:
        return copied
    for fname in TOKENIZER_FILES:
        src = Path(source_dir) / fname
        if src.is_file():
            shutil.copyfile(src, Path(out_dir) / fname)
            copied.append(fname)
    return copied
