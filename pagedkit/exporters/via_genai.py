"""`paged-export --via genai`: the second export route, for architectures with no native pagedkit family.

    paged-export --via genai --model ./phi-2 --output phi2-paged [--dtype fp32|fp16|bf16] [--kv-cache int8 ...]

1. The local checkpoint folder (config.json + *.safetensors + a tokenizer; no remote code, no pickles) is
   checked against the table below, then onnxruntime-genai's model builder runs on it offline
   (`python -m onnxruntime_genai.models.builder`, HF_HUB_OFFLINE=1) into a temporary folder, producing its
   GroupQueryAttention layout: `-e cpu -p fp32` for --dtype fp32 (the only float32 GQA layout it writes),
   `-e cuda -p fp16|bf16` otherwise (building needs no GPU). --num-layers is its `num_hidden_layers`;
   --weights int4 its `-p int4` (accuracy_level, a float LM head through nodes_to_exclude).
2. pagedkit corrects what it knows the builder gets wrong or leaves non-standard (genai_fixups.py) and checks
   the builder's attention windows against the config's (`sliding_window` / `layer_types`).
3. pagedkit's rewriter turns every GroupQueryAttention node into PagedAttention (rewriters/gqa_to_paged.py;
   float16 caches for a float32 graph, bfloat16 with --kv-cache bf16), --block-size goes to the config.
4. KV-cache dtype / quantization / rotation as the native route (paged_caches.py; PER_TENSOR / PER_CHANNEL
   scales calibrated on the unquantized rewrite, exports.quantize.calibrate).
5. genai_config.json: the builder's, in the paged layout, with the "pagedkit" section whose `source`
   records the route and the checkpoint (`paged-run OUT --parity` then works as on native exports), then
   the same validation as native exports (export.check_exported).

Served: the builder architectures of SERVED (genai_served.py), each checked against Hugging Face eager by
tests/test_export_via_genai.py. Every other architecture the installed builder knows is refused with the
reason (NOT_SERVED, or the generic reasons of `refusal`). A builder failure is one line naming the builder's
own message.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from .. import settings
from .genai_served import NOT_SERVED, SERVED, builder_architectures, refusal, served_model_types  # noqa: F401

BUILDER_MODULE = "onnxruntime_genai.models.builder"
ROUTE = "genai"


class BuilderFailed(ValueError):
    """onnxruntime-genai's builder failed on the checkpoint; the message is one line with its own error."""


def config_problem(architecture: str, cfg: dict) -> str | None:
    """A configuration of a served architecture whose math the builder does not export (measured), or None."""
    if architecture == "PhiForCausalLM" and cfg.get("qk_layernorm"):
        return "qk_layernorm true: the builder drops Phi's Q/K LayerNorms"
    if architecture == "OlmoForCausalLM" and cfg.get("clip_qkv") is not None:
        return f"clip_qkv {cfg['clip_qkv']}: the builder does not clamp Q/K/V"
    if architecture == "SmolLM3ForCausalLM" and 0 in (cfg.get("no_rope_layers") or []):
        return "NoPE layers (no_rope_layers has 0 entries): the builder fails on them (KeyError: 'position_ids')"
    if architecture == "Phi3ForCausalLM" and cfg.get("max_position_embeddings") != cfg.get(
            "original_max_position_embeddings", cfg.get("max_position_embeddings")):
        return ("LongRoPE (max_position_embeddings != original_max_position_embeddings): the builder switches its "
                "short / long cos caches on attention_mask, which the paged rewrite removes")
    return None


def _native(model_type: str) -> str:
    from .registry import families

    return (f"; the native route serves model_type {model_type!r} (paged-export without --via)"
            if model_type in families() else "")


def checkpoint(model: str | os.PathLike) -> tuple[Path, dict, str]:
    """(folder, config dict, architecture) of a checkpoint the route serves; WeightsError /
    NotImplementedError (one line) otherwise."""
    from .weights import PICKLE_SUFFIXES, WeightsError, _refuse_remote_code

    path = Path(model).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        raise WeightsError(f"{model}: --via genai needs a local checkpoint folder (config.json + *.safetensors); "
                           "built-in names, GGUF files and config-only folders are exported by the native route")
    cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    _refuse_remote_code(cfg, str(path))
    if not any(path.glob("*.safetensors")):
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        raise WeightsError(f"{path}: no *.safetensors" + (f" (only pickle weights: {', '.join(pickles[:3])})"
                                                          if pickles else "") + "; --via genai needs safetensors weights")
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise WeightsError(f"{path}: no tokenizer (tokenizer.json / tokenizer.model / vocab.json): onnxruntime-genai's "
                           "builder loads the checkpoint's tokenizer")
    archs = cfg.get("architectures") or []
    if not archs:
        raise WeightsError(f"{path}/config.json has no 'architectures': the builder picks its exporter by "
                           "architectures[0]")
    arch, model_type = archs[0], cfg.get("model_type", "?")
    why = refusal(arch) or config_problem(arch, cfg)
    if why:
        raise NotImplementedError(f"--via genai: {arch} (model_type {model_type!r}): {why}{_native(model_type)}")
    return path, cfg, arch


def hf_config(cfg: dict):
    """The transformers config of a config.json dict (its derived fields: layer_types, unused windows nulled)."""
    from .weights import _config_from_dict

    return _config_from_dict(cfg, "config.json")


def builder_args(precision: str, num_layers: int | None, int4: dict | None = None) -> list[str]:
    """The builder's -e / -p / --extra_options for pagedkit's --dtype (GQA layouts only: float32 is -e cpu's)
    and --weights int4 (-p int4: float32 activations on -e cpu, float16 / bfloat16 on -e cuda; int4 = {
    "accuracy_level": 0..4, "lm_head": bool}: a float LM head keeps a tied table unshared and float)."""
    ep = "cpu" if precision == "fp32" else "cuda"
    extra = ["hf_token=false"] + ([f"num_hidden_layers={num_layers}"] if num_layers else [])
    if int4 is None:
        return ["-e", ep, "-p", precision, "--extra_options", *extra]
    extra += [f"accuracy_level={int4['accuracy_level']}"] + ([] if int4["lm_head"] else [
        "nodes_to_exclude=/lm_head/MatMul", "shared_embeddings=false"])
    extra += ["use_cuda_bf16=true"] if precision == "bf16" else []
    return ["-e", ep, "-p", "int4", "--extra_options", *extra]


def builder_error(output: str) -> str:
    """The builder's own message from its output: the last `SomethingError: ...` line (else the last line)."""
    lines = [l.strip() for l in output.splitlines() if l.strip()]
    errors = [l for l in lines if re.match(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)|Killed)\b", l)]
    return (errors or lines or ["no output"])[-1][:500]


def run_builder(folder: Path, out: Path, cache: Path, precision: str, num_layers: int | None = None,
                timeout: float | None = None, progress: bool = False, int4: dict | None = None) -> Path:
    """Run the builder offline on `folder` into `out`; BuilderFailed (one line) when it fails."""
    cmd = [sys.executable, "-m", BUILDER_MODULE, "-i", str(folder), "-o", str(out), "-c", str(cache),
           *builder_args(precision, num_layers, int4)]
    env = settings.offline_env("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
    if progress:
        print(f"running onnxruntime-genai's builder: {' '.join(cmd[1:])}", flush=True)  # stdout: stderr is for errors
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        raise BuilderFailed(f"onnxruntime-genai's builder timed out after {timeout:.0f} s on {folder}") from exc
    if proc.returncode != 0 or not (out / "model.onnx").is_file():
        raise BuilderFailed(f"onnxruntime-genai's builder failed on {folder} (exit {proc.returncode}): "
                            f"{builder_error(proc.stdout + proc.stderr)}")
    return out


def _dtypes(opts) -> tuple[str, str]:
    """(builder precision, float cache dtype of the rewrite) for the options; ValueError for what the route
    cannot honour."""
    from .families.base import DTYPE_NAMES

    if opts.slot_mapping or opts.query_positions:
        raise ValueError("--extra-inputs with --via genai: the paged rewrite writes the builder's graph inputs only")
    if opts.max_seq_len is not None:
        raise ValueError("--max-seq-len with --via genai: the builder sizes its cos/sin caches from the config's "
                         "max_position_embeddings")
    floats = {d for d in (opts.kv.k_dtype, opts.kv.v_dtype) if d in ("float16", "bfloat16")}
    if opts.dtype == "fp32":
        return "fp32", floats.pop() if floats else "float16"
    act = DTYPE_NAMES[opts.dtype]
    if floats - {act}:
        raise ValueError(f"--kv-cache {floats.pop()} with --dtype {opts.dtype}: an unquantized cache holds the "
                         f"attention type ({act})")
    return opts.dtype, act


def export_via_genai(model: str | os.PathLike, output_dir: str | os.PathLike, opts=None, *,
                     num_layers: int | None = None, calibration: str | os.PathLike | None = None,
                     percentile: float = 100.0, weights: str = "fp16", int4_lm_head: bool = True,
                     int4_accuracy_level: int | None = None, timeout: float | None = None, validate: bool = True):
    """`paged-export --via genai` (module doc): returns export.ExportResult. weights "int4": the builder's own
    int4 (MatMulNBits, symmetric, block 32; accuracy_level 4 unless given; the LM head too unless
    int4_lm_head=False): the native route's --weights int4 writes the same tensors."""
    import onnx

    from ..interface.genai_config import GENAI_CONFIG, with_decoded_pagedkit
    from ..rewriters.gqa_to_paged import gqa_to_paged, paged_genai_config, paged_model_spec
    from .export import ExportResult, check_exported, check_options, kv_bytes_per_token, save_model
    from .families.base import DTYPE_NAMES, ExportOptions
    from .genai_fixups import check_windows, fix_builder_model
    from .paged_caches import apply_cache_options, cache_layers
    from .quantize import INT4_ACCURACY_LEVEL
    from .weights import copy_tokenizer_files

    opts = opts or ExportOptions()
    check_options(opts)
    precision, float_cache = _dtypes(opts)
    if weights not in ("fp16", "int4"):
        raise ValueError(f"weights: expected fp16 or int4, got {weights!r}")
    level = INT4_ACCURACY_LEVEL if int4_accuracy_level is None else int4_accuracy_level
    if level not in range(5):
        raise ValueError(f"int4 accuracy_level: expected 0..4, got {level!r}")
    int4 = {"accuracy_level": level, "lm_head": bool(int4_lm_head)} if weights == "int4" else None
    if not builder_architectures():
        raise ValueError("--via genai runs onnxruntime-genai's model builder: pip install onnxruntime-genai")
    folder, cfg, arch = checkpoint(model)
    if num_layers is not None and not 1 <= num_layers <= int(cfg.get("num_hidden_layers", 0)):
        raise ValueError(f"--num-layers must be in [1, {cfg.get('num_hidden_layers')}], got {num_layers}")
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".pagedkit-genai-", dir=out.parent) as tmp:  # beside the output: big
        built = run_builder(folder, Path(tmp) / "gqa", Path(tmp) / "cache", precision, num_layers, timeout,
                            progress=opts.progress, int4=int4)
        proto = onnx.load(str(built / "model.onnx"))
        source_config = json.loads((built / GENAI_CONFIG).read_text(encoding="utf-8"))
    fixes = fix_builder_model(proto, arch)
    check_windows(proto, hf_config(cfg), arch)
    import onnx_ir as ir

    dt = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}[float_cache]
    try:
        proto, report, layers = gqa_to_paged(proto, dtype=dt)
    except ValueError as exc:
        raise ValueError(f"--via genai: the paged rewrite of the builder's {arch} model refused: {exc}") from exc
    spec = paged_model_spec(source_config, layers, opts.block_size, DTYPE_NAMES[opts.dtype])
    spec.layers = cache_layers(layers, opts.kv)
    try:
        import onnxruntime_genai

        version = onnxruntime_genai.__version__
    except Exception:  # the builder ran, so the package is there; its version is informative only
        version = "?"
    spec.source = {"route": ROUTE, "model": str(model), "checkpoint": str(folder.resolve()),
                   "num_hidden_layers": num_layers or int(cfg.get("num_hidden_layers", len(layers))),
                   "weights": "safetensors", "weight_format": weights, "architecture": arch,
                   "builder": f"onnxruntime-genai {version} ({' '.join(builder_args(precision, num_layers, int4))})",
                   "rewrite": "gqa -> paged", "fixes": fixes}
    if int4:
        spec.source |= {"int4_lm_head": int4["lm_head"], "int4_accuracy_level": level}
    notes = [f"via onnxruntime-genai {version}'s builder ({arch}, -p {'int4' if int4 else precision}), then the "
             f"paged rewrite ({len(report.changed)} attention nodes)"] + [f"builder fix: {f}" for f in fixes]
    proto, spec.calibration, note = apply_cache_options(proto, spec, opts, calibration, folder, percentile)
    notes += [note] if note else []
    params = sum(math.prod(t.dims) for t in proto.graph.initializer)
    path = save_model(proto, out, spec.filename)
    del proto
    config = paged_genai_config(source_config, spec)
    (out / GENAI_CONFIG).write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    copy_tokenizer_files(folder, out)
    if validate:
        check_exported(path, with_decoded_pagedkit(config))
    data = path.with_name(path.name + ".data")
    files = [path] + ([data] if data.exists() else [])
    return ExportResult(out, path, spec, params, sum(f.stat().st_size for f in files), kv_bytes_per_token(spec),
                        "safetensors", notes)


def main_via_genai(args, kv) -> int:
    """`paged-export --via genai ...` (exporters/cli.py): flags the route cannot honour are refused (one line,
    status 2); an export that fails validation is status 1."""
    from ..cli_errors import EXIT_FAILED, one_line
    from .export import ExportError
    from .families.base import ExportOptions

    if args.weights != "int4" and (args.int4_lm_head is not None or args.int4_accuracy_level is not None):
        raise ValueError("--int4-lm-head / --no-int4-lm-head / --int4-accuracy-level need --weights int4")
    refused = [flag for flag, given in (
        ("--num-experts", args.num_experts), ("--extra-inputs", args.extra_inputs.strip()),
        ("--max-seq-len", args.max_seq_len is not None), ("--seed", args.seed != 0)) if given]
    if refused:
        raise ValueError(f"{', '.join(refused)} with --via genai: not applied by this route (the builder exports "
                         "the checkpoint's weights, all its experts, its own graph inputs and context length); use "
                         "the native route for these")
    opts = ExportOptions(dtype=args.dtype, block_size=args.block_size, kv=kv, progress=not args.quiet)
    try:
        result = export_via_genai(args.model, args.output, opts, num_layers=args.num_layers,
                                  calibration=args.calibration, percentile=args.calibration_percentile,
                                  weights=args.weights, int4_lm_head=args.int4_lm_head is not False,
                                  int4_accuracy_level=args.int4_accuracy_level)
    except ExportError as exc:
        print(f"paged-export: error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_FAILED
    print(result.summary())
    return 0


__all__ = ["main_via_genai", "BuilderFailed", "NOT_SERVED", "SERVED", "builder_architectures", "checkpoint", "export_via_genai",
           "refusal", "served_model_types"]
