"""Export orchestration: Hugging Face model -> model.onnx + genai_config.json (+ tokenizer files), checked
by `onnx.checker.check_model(full_check=True)` and pagedkit's `validate_model` before success is declared.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx
import torch

from ..validators.contract import block_size_error
from ..interface import dtypes
from ..interface.genai_config import ModelSpec, genai_config, with_decoded_pagedkit, write_genai_config
from ..validators.contract import cache_format, cache_width
from .families.base import FLOAT_TYPES, ExportContext, ExportOptions, KVOptions
from .external import data_files, parse_size, remove_data_files
from .lazy import LazyTensor, lazy_parameters
from .quantize import INT4_ACCURACY_LEVEL, INT4_BLOCK_SIZE
from .registry import family_for
from .weights import copy_tokenizer_files, load_model

# models with more initializer bytes keep them in model.onnx.data: onnxruntime then maps them from the file instead of
# copying them out of the model's bytes (SmolLM2-135M int4, 86 MB: 0.90 GB peak inline, 0.5 GB external)
EXTERNAL_DATA_BYTES = 16 << 20


class ExportError(RuntimeError):
    """The exported graph failed the ONNX checker or pagedkit's validator; the message lists why."""


@dataclass
class ExportResult:
    output_dir: Path
    model_path: Path
    spec: ModelSpec
    parameters: int
    file_bytes: int
    kv_bytes_per_token: float
    weights: str  # "safetensors" | "gguf" | "random"
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"exported {self.spec.model_type} ({len(self.spec.layers)} layers, {self.weights} weights) "
            f"-> {self.model_path}",
            f"  parameters:           {self.parameters:,}",
            f"  file size:            {self.file_bytes / 2**20:,.1f} MiB",
            f"  KV cache per token:   {self.kv_bytes_per_token:,.0f} bytes "
            f"({describe_caches(self.spec)}, block_size {self.spec.block_size})",
        ]
        return "\n".join(lines + [f"  {n}" for n in self.notes])


def describe_caches(spec: ModelSpec) -> str:
    kinds = sorted({(l.k_cache.dtype, l.k_cache.quant, l.v_cache.dtype if l.v_cache else None,
                     l.v_cache.quant if l.v_cache else None) for l in spec.layers}, key=str)
    out = []
    for kd, kq, vd, vq in kinds:
        k = kd + ("" if kq == "NONE" else f" {kq}")
        v = "" if vd is None else vd + ("" if vq == "NONE" else f" {vq}")
        out.append(f"K {k}" + (f" / V {v}" if v else ""))
    return "; ".join(out)


def _storage_bytes(cache_dtype: str) -> int:
    """Bytes of one stored cache element (int4: one uint8 holding two channels)."""
    return dtypes.numpy_dtype(dtypes.elem_type(cache_format(cache_dtype).storage)).itemsize


def kv_bytes_per_token(spec: ModelSpec) -> float:
    """Cache bytes one token occupies over all layers (scale caches included)."""
    total = 0.0
    for l in spec.layers:
        for c in (l.k_cache, l.v_cache):
            if c is None:
                continue
            total += l.kv_num_heads * cache_width(c.dtype, l.head_size) * _storage_bytes(c.dtype)
            if c.quant == "PER_TOKEN":
                total += l.kv_num_heads * 2  # float16 scale per token and KV head
    return total


def check_options(opts: ExportOptions) -> None:
    """Refuse options the operator contract cannot run, before any work (ValueError, the contract's text)."""
    err = block_size_error(opts.block_size)
    if err:
        raise ValueError(err)
    if opts.dtype not in FLOAT_TYPES:
        raise ValueError(f"dtype: expected one of {', '.join(FLOAT_TYPES)}, got {opts.dtype!r}")
    floats = {d for d in (opts.kv.k_dtype, opts.kv.v_dtype) if d in ("float16", "bfloat16")}
    if opts.dtype == "fp32" and len(floats) > 1:
        raise ValueError(f"dtype fp32: K cache {opts.kv.k_dtype} and V cache {opts.kv.v_dtype} differ; each "
                         "attention node runs in its caches' float type (one T): give both sides one dtype")


def build_model(hf_model: torch.nn.Module, opts: ExportOptions | None = None, *, progress: bool = False,
                external_data: Path | None = None, max_shard_bytes: int | None = None,
                int4: tuple[int, int, bool] | None = None, stats: dict | None = None
                ) -> tuple[onnx.ModelProto, ModelSpec]:
    """The PagedAttention graph of a Hugging Face causal LM (in memory, or streamed: checkpoint.streamed_model),
    and its ModelSpec. external_data: a file to stream the weights into, one initializer at a time as each is
    evaluated (large ones in row chunks), when they exceed EXTERNAL_DATA_BYTES (the proto then references it:
    save it beside the file with `save_model`); max_shard_bytes: split it into files of at most this size.
    int4 (block_size, accuracy_level, lm_head): `--weights int4`, quantized as the weights are written
    (int4_stream.py). stats: filled with {"prequant": MatMulNBits nodes of a GPTQ / AWQ checkpoint}."""
    opts = opts or ExportOptions()
    check_options(opts)
    family = family_for(hf_model.config)
    ctx = ExportContext(family, hf_model, opts)
    layers = range(len(family.layers(hf_model)))
    if progress:
        from tqdm.auto import tqdm

        layers = tqdm(layers, desc="layers", unit="layer", file=sys.stderr)
    with torch.no_grad(), lazy_parameters(hf_model):  # weight transforms recorded, evaluated when written
        family.build(ctx, layers)
    if stats is not None:
        stats["prequant"] = sum(1 for node in ctx.g.nodes if node.op_type == "MatMulNBits")
    if int4 is not None:
        from .int4_stream import quantize_builder_int4

        quantize_builder_int4(ctx.g, *int4)
    doc = f"pagedkit export of {hf_model.config.model_type} (family {family.name})"
    stream = external_data if external_data is not None and ctx.g.nbytes() > EXTERNAL_DATA_BYTES else None
    if stream is not None:
        Path(stream).parent.mkdir(parents=True, exist_ok=True)
    return ctx.g.model("pagedkit_" + family.name, "pagedkit", doc, external=stream,
                       max_shard_bytes=max_shard_bytes), ctx.spec


def save_model(proto: onnx.ModelProto, out_dir: Path, filename: str = "model.onnx") -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    data = out_dir / f"{filename}.data"
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
        onnx.save_model(proto, path)  # weights already streamed to `data` (build_model's external_data)
        return path
    remove_data_files(path)
    size = sum(len(t.raw_data) for t in proto.graph.initializer)
    onnx.save_model(proto, path, save_as_external_data=size > EXTERNAL_DATA_BYTES, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    return path


def check_exported(path: Path, config: dict) -> None:
    """onnx.checker (full_check) and pagedkit's validate_model; raises ExportError listing every problem."""
    from ..validators import validate_model

    problems = []
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as exc:  # onnx raises ValidationError / InferenceError
        problems.append(f"onnx.checker: {exc}")
    issues = validate_model(str(path), genai_config=with_decoded_pagedkit(config))
    problems += [str(i) for i in issues]
    if problems:
        raise ExportError(f"{path}: the exported model is invalid:\n" + "\n".join(f"  - {p}" for p in problems))


def export_hf_model(hf_model: torch.nn.Module, output_dir: str | os.PathLike, opts: ExportOptions | None = None, *,
                    weights: str = "in-memory", source: dict | None = None, tokenizer_dir: Path | None = None,
                    weight_format: str = "fp16", calibration: str | os.PathLike | None = None,
                    percentile: float = 100.0, validate: bool = True, int4_lm_head: bool = True,
                    int4_accuracy_level: int = INT4_ACCURACY_LEVEL, max_shard_size: str | int | None = None
                    ) -> ExportResult:
    """Export an in-memory HF model to output_dir (model.onnx, genai_config.json, tokenizer files).

    Quantized caches: the unquantized graph is built first and run over the calibration text (default:
    the text shipped with pagedkit) for PER_TENSOR / PER_CHANNEL scales and the per-layer SNR report.
    weight_format "int4": MatMul weights to MatMulNBits (onnxruntime's quantizer, block 32, accuracy_level
    `int4_accuracy_level`), the LM head included unless int4_lm_head=False; a tied embedding then reads the
    LM head's int4 weight through GatherBlockQuantized (quantize.quantize_weights_int4)."""
    return _export([hf_model], output_dir, opts, weights=weights, source=source, tokenizer_dir=tokenizer_dir,
                   weight_format=weight_format, calibration=calibration, percentile=percentile, validate=validate,
                   int4_lm_head=int4_lm_head, int4_accuracy_level=int4_accuracy_level,
                   max_shard_size=max_shard_size)


def _export(holder: list, output_dir, opts, *, weights, source, tokenizer_dir, weight_format, calibration,
            percentile, validate, int4_lm_head=True, int4_accuracy_level=INT4_ACCURACY_LEVEL,
            max_shard_size=None) -> ExportResult:
    """export_hf_model's work; the model is taken out of `holder` and dropped once the graph is built (the
    caller that owns it, `export`, then no longer keeps a float copy of every weight alive)."""
    from .quantize import calibrate, calibration_sequences, needs_calibration

    hf_model = holder.pop()
    opts = opts or ExportOptions()
    check_options(opts)
    if weight_format not in ("fp16", "int4"):
        raise ValueError(f"weights: expected fp16 or int4, got {weight_format!r}")
    if int4_accuracy_level not in range(5):
        raise ValueError(f"int4 accuracy_level: expected 0..4, got {int4_accuracy_level!r}")
    out = Path(output_dir)
    notes = []
    calib = None
    family = family_for(hf_model.config)
    final_spec = family.model_spec(hf_model, opts)
    if needs_calibration(final_spec.layers):
        base_opts = replace(opts, kv=KVOptions(), kv_scales={}, progress=False)
        base, _ = build_model(hf_model, base_opts)
        seqs = calibration_sequences(calibration, tokenizer_dir, hf_model.config.vocab_size)
        scales, calib = calibrate(base, final_spec, seqs, percentile)
        del base
        opts = replace(opts, kv_scales=scales)
        calib["text"] = str(calibration) if calibration else "pagedkit built-in calibration text"
        notes.append("KV quantization SNR (dB) per layer: " + ", ".join(
            f"{i}: K {r.get('k_snr_db', '-')} / V {r.get('v_snr_db', '-')}" for i, r in calib["snr_db"].items()))
    stream = out / f"{final_spec.filename}.data"
    remove_data_files(out / final_spec.filename)
    streamed = any(isinstance(p, LazyTensor) for p in hf_model.parameters())
    int4 = (INT4_BLOCK_SIZE, int4_accuracy_level, int4_lm_head) if weight_format == "int4" else None
    stats: dict = {}
    proto, spec = build_model(hf_model, opts, progress=opts.progress, external_data=stream,
                              max_shard_bytes=parse_size(max_shard_size), int4=int4, stats=stats)
    params = sum(p.numel() for p in hf_model.parameters())
    if streamed:
        notes.append("random weights drawn tensor by tensor while written (streamed)" if weights == "random" else
                     "weights read from the checkpoint tensor by tensor while written (streamed)")
    prequant = stats["prequant"]
    if prequant:
        notes.append(f"int4 checkpoint: {prequant} linears -> MatMulNBits over the checkpoint's own codes")
    del hf_model
    spec.calibration = calib
    spec.source = dict(source or {}) | {"weights": weights, "weight_format": weight_format}
    if weight_format == "int4":
        spec.source |= {"int4_lm_head": bool(int4_lm_head), "int4_accuracy_level": int(int4_accuracy_level)}
        n = sum(1 for node in proto.graph.node if node.op_type == "MatMulNBits") - prequant
        head = next((node.op_type for node in proto.graph.node if node.name.startswith("/lm_head/")
                     and node.op_type in ("MatMul", "MatMulNBits", "Gemm")), "?")
        embed = next((node.op_type for node in proto.graph.node if node.name.startswith("/model/embed_tokens/")
                      and node.op_type in ("Gather", "GatherBlockQuantized")), "?")
        notes.append(f"int4 weights: {n} MatMul nodes -> MatMulNBits (block {INT4_BLOCK_SIZE}, symmetric, "
                     f"accuracy_level {int4_accuracy_level}); lm_head {head}, embedding {embed}")
        moe = [node.op_type for node in proto.graph.node if node.op_type in ("MoE", "QMoE")]
        if moe:
            notes.append(f"int4 experts: {moe.count('QMoE')} MoE nodes -> QMoE (block {INT4_BLOCK_SIZE}), "
                         f"{moe.count('MoE')} left float (sizes not whole blocks)")
    path = save_model(proto, out, spec.filename)
    del proto
    write_genai_config(out, spec)
    copy_tokenizer_files(tokenizer_dir, out)
    if validate:
        check_exported(path, genai_config(spec))
    files = [path] + data_files(path)
    if len(files) > 2:
        notes.append(f"external data: {len(files) - 1} files ({files[1].name} .. {files[-1].name})")
    return ExportResult(out, path, spec, params, sum(f.stat().st_size for f in files), kv_bytes_per_token(spec),
                        weights, notes)


def export(model: str | os.PathLike, output_dir: str | os.PathLike, opts: ExportOptions | None = None, *,
           num_layers: int | None = None, num_experts: int | None = None, seed: int = 0, weights: str = "fp16",
           calibration: str | os.PathLike | None = None, percentile: float = 100.0,
           validate: bool = True, int4_lm_head: bool = True, int4_accuracy_level: int = INT4_ACCURACY_LEVEL,
           max_shard_size: str | int | None = None, stream: bool = True) -> ExportResult:
    """`paged-export`'s work: load (local safetensors / GGUF / built-in config) in the export dtype, export,
    check, summarize. stream (default): a safetensors checkpoint is read tensor by tensor as the weights are
    written (checkpoint.py), never loaded whole; False: loaded with from_pretrained first.
    max_shard_size ('4GB', bytes, None): split the external data into files of at most that size."""
    opts = opts or ExportOptions()
    check_options(opts)  # before any loading
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[opts.dtype]
    parse_size(max_shard_size)  # refused before any loading
    loaded = load_model(model, num_layers=num_layers, num_experts=num_experts, seed=seed, dtype=dtype, stream=stream)
    source = {"model": str(model), "num_hidden_layers": loaded.config.num_hidden_layers}
    if loaded.checkpoint is not None:  # the local weights, for `paged-run --parity` without a second path
        source["checkpoint"] = str(loaded.checkpoint)
    holder, tokenizer_dir, kind = [loaded.model], loaded.source_dir, loaded.weights
    del loaded
    return _export(holder, output_dir, opts, weights=kind, source=source, tokenizer_dir=tokenizer_dir,
                   weight_format=weights, calibration=calibration, percentile=percentile, validate=validate,
                   int4_lm_head=int4_lm_head, int4_accuracy_level=int4_accuracy_level, max_shard_size=max_shard_size)
