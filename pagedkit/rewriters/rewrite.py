"""File-level rewrite (what `paged-rewrite` runs): load a model safely, rewrite it, validate, save it with its
genai_config.json.

    report = rewrite_file("gqa/model.onnx", "paged/model.onnx", to="paged")
    print(report)

- to="paged": GroupQueryAttention -> PagedAttention (gqa_to_paged.py), config in the paged layout.
- to="gqa":   PagedAttention -> GroupQueryAttention (paged_to_gqa.py), config in the GQA layout.
- to="decomposed": every PagedAttention node as standard ONNX ops (decompose.py), config copied.
Loading follows the rules of validation (validators/model_loading.py, interface/paths.py): the graph is read
without its weights first, every external-data location must be a relative path inside the model's folder,
and genai_config.json is read only from inside it. Weights stay lazy (onnx-ir) and are written as external
data beside the output when the source had external data (or exceeds 2 GB).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import onnx
import onnx_ir as ir

from pagedkit.interface.genai_config import GENAI_CONFIG
from pagedkit.validators.contract import block_size_error
from pagedkit.validators.genai_schema import check_genai_config
from pagedkit.validators.model import check_model
from pagedkit.validators.model_loading import ModelLoadError, config_path, external_data_problems, \
    load_model_proto, resolve_model_path

from .report import RewriteRefused, RewriteReport

TARGETS = ("paged", "gqa", "decomposed")
DEFAULT_BLOCK_SIZE = 256  # what onnxruntime-genai's builder writes for its paged layout


class RewriteInvalid(RuntimeError):
    """The rewritten model failed pagedkit's validator (validate_model; a bug: the message lists why). The ONNX
    checker is not run: builder models use contrib ops in the default domain (SimplifiedLayerNormalization)
    that it does not know."""


def _load(src: Path) -> tuple[ir.Model, dict | None, bool]:
    """(model with lazy weights, the genai_config beside it or None, whether it used external data)."""
    model_path, config, issues = resolve_model_path(src)
    if issues:
        raise ModelLoadError("; ".join(str(i) for i in issues))
    if config is not None:  # the source's fields, refused before anything is rewritten (genai_schema.py)
        check_genai_config(config, str(config_path(src)))
    proto = load_model_proto(model_path)
    problems = external_data_problems(proto, model_path.parent)
    if problems:
        raise ModelLoadError(f"{model_path}: unsafe external data: " + "; ".join(str(i) for i in problems[:3]))
    external = any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    return ir.load(str(model_path)), config, external


def rewrite_model(model: ir.Model, to: str, *, config: dict | None = None, block_size: int | None = None
                  ) -> tuple[ir.Model, RewriteReport, dict | None]:
    """Rewrite an ir.Model in place: (model, report, the new genai_config or None when none was given)."""
    if to not in TARGETS:
        raise ValueError(f"--to should be one of {', '.join(TARGETS)}, got {to!r}")
    if block_size is not None and to != "paged":
        raise ValueError("--block-size applies to --to paged only")
    bs = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    err = block_size_error(bs)
    if err:
        raise ValueError(err)
    new_config = None
    if to == "paged":
        from .gqa_to_paged import gqa_to_paged, paged_genai_config, paged_model_spec

        _, report, layers = gqa_to_paged(model)
        if config is not None:
            dt = "float16" if layers and layers[0].k_cache.dtype == "float16" else "bfloat16"
            new_config = paged_genai_config(config, paged_model_spec(config, layers, bs, dt))
        report.model.append(f"block size {bs} (genai_config engine.dynamic_batching.block_size)")
    elif to == "gqa":
        from .paged_to_gqa import gqa_genai_config, paged_to_gqa

        _, report = paged_to_gqa(model)
        new_config = gqa_genai_config(config) if config is not None else None
    else:
        from .decompose import decompose

        _, dreport = decompose(model)
        report = RewriteReport("decompose", list(dreport.changed), list(dreport.skipped))
        if dreport.skipped:
            raise RewriteRefused("; ".join(f"{n}: {r}" for n, r in dreport.skipped))
        if not dreport.changed:
            raise RewriteRefused("no com.microsoft::PagedAttention node to decompose")
        new_config = config
        report.model.append("cache outputs are new tensors (onnxruntime does not alias): feed present back as past")
    return model, report, new_config


def _validate(path: Path, config: dict | None) -> None:
    report = check_model(path, genai_config=config)
    problems = [str(i) for i in report.issues]
    if problems:
        raise RewriteInvalid(f"the rewritten model {path} is invalid: " + "; ".join(problems[:5]))


def rewrite_file(src: str | os.PathLike, dst: str | os.PathLike, to: str, *, block_size: int | None = None
                 ) -> RewriteReport:
    """Rewrite the model at `src` (a .onnx file, or a model folder) into `dst` (a .onnx file), write the
    derived genai_config.json beside it when `src` has one, and validate the result (RewriteInvalid)."""
    src, dst = Path(src), Path(dst)
    if to not in TARGETS:
        raise ValueError(f"--to should be one of {', '.join(TARGETS)}, got {to!r}")
    if block_size is not None:
        err = block_size_error(block_size)
        if err:
            raise ValueError(err)
    if dst.suffix != ".onnx":
        raise ValueError(f"the output should be a .onnx file, got {dst}")
    model, config, external = _load(src)
    src_file = resolve_model_path(src)[0]
    if dst.resolve() == src_file.resolve():
        raise ValueError(f"the output {dst} is the input model: write to another file")
    data_name = dst.name + ".data"
    if external and (dst.parent / data_name).resolve() in {(src_file.parent / t).resolve() for t in _data_files(src_file)}:
        raise ValueError(f"the output's external data {dst.parent / data_name} is the input's: write elsewhere")
    model, report, new_config = rewrite_model(model, to, config=config, block_size=block_size)
    dst.parent.mkdir(parents=True, exist_ok=True)
    big = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None) >= 2 << 30
    if external or big:
        if (dst.parent / data_name).exists():
            (dst.parent / data_name).unlink()
        ir.save(model, str(dst), external_data=data_name)
    else:
        ir.save(model, str(dst))
    if new_config is not None:
        new_config = json.loads(json.dumps(new_config))
        new_config.setdefault("model", {}).setdefault("decoder", {})["filename"] = dst.name
        (dst.parent / GENAI_CONFIG).write_text(json.dumps(new_config, indent=4) + "\n", encoding="utf-8")
        report.model.append(f"wrote {dst.parent / GENAI_CONFIG}")
    _validate(dst, new_config)
    return report


def _data_files(model_path: Path) -> set[str]:
    proto = onnx.load(str(model_path), load_external_data=False)
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    return {ExternalDataInfo(t).location for t in proto.graph.initializer if uses_external_data(t)}


__all__ = ["DEFAULT_BLOCK_SIZE", "TARGETS", "RewriteInvalid", "rewrite_file", "rewrite_model"]
