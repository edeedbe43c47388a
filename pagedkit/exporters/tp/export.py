"""`paged-export --tp N`: one graph per rank and one genai_config.json for the set.

    OUT/genai_config.json          the whole model's numbers (heads, KV heads, vocabulary, layers) as a
                                   single-device export writes them; model.decoder.filename = rank_0/model.onnx;
                                   the "pagedkit" section's "tensor_parallel" names the world size, each rank's
                                   file, the heads / KV heads / vocabulary rows per rank and how KV heads are
                                   placed ("split", "replicated xR", "latent (replicated)")
    OUT/rank_<r>/model.onnx (+ model.onnx.data)   rank r's graph (build.py)
    OUT/tokenizer files

Each rank's graph is checked like any export (onnx.checker full_check, pagedkit's validator with the set's
genai_config: the collectives' group_size must equal the world size) before success is declared. KV caches
quantized with static scales (PER_TENSOR / PER_CHANNEL) are calibrated once on the unsharded graph; each rank
gets its KV heads' scales.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from ...interface.genai_config import GENAI_CONFIG, PAGEDKIT_KEY, genai_config
from ..export import (EXTERNAL_DATA_BYTES, ExportResult, build_model, check_exported, check_options,
                      kv_bytes_per_token, save_model)
from ..families.base import ExportOptions, KVOptions
from ..quantize import INT4_ACCURACY_LEVEL, INT4_BLOCK_SIZE
from ..registry import family_for
from .build import build_rank
from .plan import make_plan

TP_KEY = "tensor_parallel"


def rank_file(rank: int) -> str:
    return f"rank_{rank}/model.onnx"


def tp_config(spec, plan) -> dict:
    """The set's genai_config.json content: the whole model's, decoder filename rank 0's, plus the
    tensor_parallel entry of the pagedkit section."""
    config = genai_config(replace(spec, filename=rank_file(0)))
    section = json.loads(config[PAGEDKIT_KEY])
    section[TP_KEY] = plan.to_json() | {"ranks": [rank_file(r) for r in range(plan.world)]}
    config[PAGEDKIT_KEY] = json.dumps(section, sort_keys=True)
    return config


def export_tp_model(hf_model: torch.nn.Module, output_dir: str | os.PathLike, opts: ExportOptions | None = None,
                    *, tp: int, weights: str = "in-memory", source: dict | None = None, tokenizer_dir: Path | None = None,
                    weight_format: str = "fp16", calibration: str | os.PathLike | None = None,
                    percentile: float = 100.0, validate: bool = True, int4_lm_head: bool = True,
                    int4_accuracy_level: int = INT4_ACCURACY_LEVEL) -> ExportResult:
    """Export an in-memory Hugging Face model as `tp` ranks to output_dir (module docstring)."""
    from ..quantize import calibrate, calibration_sequences, needs_calibration, quantize_weights_int4
    from ..weights import copy_tokenizer_files

    opts = opts or ExportOptions()
    check_options(opts)
    if weight_format not in ("fp16", "int4"):
        raise ValueError(f"weights: expected fp16 or int4, got {weight_format!r}")
    family = family_for(hf_model.config)
    plan = make_plan(hf_model, family, tp, block=INT4_BLOCK_SIZE if weight_format == "int4" else None)
    spec = family.model_spec(hf_model, opts)
    out = Path(output_dir)
    notes = []
    if needs_calibration(spec.layers):
        base, _ = build_model(hf_model, replace(opts, kv=KVOptions(), kv_scales={}, progress=False))
        seqs = calibration_sequences(calibration, tokenizer_dir, hf_model.config.vocab_size)
        scales, spec.calibration = calibrate(base, spec, seqs, percentile)
        del base
        opts = replace(opts, kv_scales=scales)
    spec.source = dict(source or {}) | {"weights": weights, "weight_format": weight_format, "tensor_parallel": tp}
    config = tp_config(spec, plan)
    out.mkdir(parents=True, exist_ok=True)
    (out / GENAI_CONFIG).write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    files, rank_spec = [], None
    for r in range(tp):
        folder = out / f"rank_{r}"
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "model.onnx.data"
        if data.exists():
            data.unlink()
        stream = data if weight_format == "fp16" else None  # int4 rewrites the proto
        proto, rank_spec = build_rank(hf_model, opts, plan, r, external=stream, min_external_bytes=EXTERNAL_DATA_BYTES)
        if weight_format == "int4":
            proto = quantize_weights_int4(proto, accuracy_level=int4_accuracy_level, lm_head=int4_lm_head)
        path = save_model(proto, folder, "model.onnx")
        del proto
        if validate:
            check_exported(path, config)
        files += [path] + ([data] if data.exists() else [])
    copy_tokenizer_files(tokenizer_dir, out)
    per_rank = kv_bytes_per_token(rank_spec)
    notes.append(f"tensor parallel: {tp} ranks (rank_<r>/model.onnx); per rank {plan.heads_per_rank} query heads, "
                 f"{plan.kv_per_rank} KV head(s) ({plan.to_json()['kv_heads']}), {plan.vocab_per_rank} vocabulary "
                 f"rows; KV cache {per_rank:,.0f} bytes per token per rank ({tp * per_rank:,.0f} over the ranks)")
    params = sum(p.numel() for p in hf_model.parameters())
    return ExportResult(out, out / rank_file(0), replace(spec, filename=rank_file(0)), params,
                        sum(f.stat().st_size for f in files), kv_bytes_per_token(spec), weights, notes)


def export_tp(model: str | os.PathLike, output_dir: str | os.PathLike, opts: ExportOptions | None = None, *,
              tp: int, num_layers: int | None = None, num_experts: int | None = None, seed: int = 0,
              weights: str = "fp16", calibration=None, percentile: float = 100.0, validate: bool = True,
              int4_lm_head: bool = True, int4_accuracy_level: int = INT4_ACCURACY_LEVEL,
              max_shard_size: str | int | None = None, stream: bool = True) -> ExportResult:
    """`paged-export --tp N`'s work: load (as `export.export`), cut, export every rank, check, summarize.
    The checkpoint is loaded in memory (streaming a tensor-parallel export is planned: `stream` has no effect
    here); a rank's weights go to one external-data file (`max_shard_size` is refused)."""
    from ..weights import load_model

    if max_shard_size is not None:
        raise ValueError("--max-shard-size: not supported with --tp yet (each rank writes one external-data file)")
    opts = opts or ExportOptions()
    check_options(opts)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[opts.dtype]
    loaded = load_model(model, num_layers=num_layers, num_experts=num_experts, seed=seed, dtype=dtype)
    source = {"model": str(model), "num_hidden_layers": loaded.config.num_hidden_layers}
    if loaded.checkpoint is not None:
        source["checkpoint"] = str(loaded.checkpoint)
    return export_tp_model(loaded.model, output_dir, opts, tp=tp, weights=loaded.weights, source=source,
                           tokenizer_dir=loaded.source_dir, weight_format=weights, calibration=calibration,
                           percentile=percentile, validate=validate, int4_lm_head=int4_lm_head,
                           int4_accuracy_level=int4_accuracy_level)
