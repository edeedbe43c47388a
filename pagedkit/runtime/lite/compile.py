"""Make the torch-free CPU plan of a model folder (runtime/lite/artifact.py says what and where):

    python -m pagedkit.runtime.lite.compile MODEL_DIR --threads N --out PLAN_DIR

It runs runtime/delegate.py on the model as InferenceSession's onnxruntime CPU backend does, requires the result
to be one onnxruntime segment, names the role of each of its inputs (the step inputs of the operator contract, the
caches, the LM head's row selection) and writes segment.onnx + plan.json. Its last stdout line is one JSON object:
{"plan": PLAN_DIR} or {"refused": why}. This process imports torch (the delegation's modules do); the runner's
process does not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import onnx
from onnx.external_data_helper import set_external_data, uses_external_data

from ...interface import dtypes
from ...interface import names as N
from ...interface.genai_config import GENAI_CONFIG
from ...kernels.cpu.logits import ROWS_INPUT
from ...interface.paths import inside_folder
from ..generate import read_config
from .artifact import DATA_FILE, IN_FOLDER, PLAN_FILE, PLAN_VERSION, SEGMENT_FILE, LiteUnavailable

# step inputs the runner makes (names.* -> plan.json role); every other input must be a cache
STEP_ROLES = {N.INPUT_IDS: "input_ids", N.CUMULATIVE_SEQUENCE_LENGTHS: "cu_seqlens",
              N.PAST_SEQUENCE_LENGTHS: "past_seqlens", N.BLOCK_TABLE: "block_table", N.SLOT_MAPPING: "slot_mapping",
              N.QUERY_POSITIONS: "query_positions"}  # attention_metadata: not made (refused as an unknown input)
_INLINE_MAX = 1024  # bytes: a larger inline tensor goes to segment.data when the plan lies in the model folder


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in vi.type.tensor_type.shape.dim]


def build_plan(folder: Path, threads: int) -> tuple[onnx.ModelProto, dict]:
    """(the segment's model, plan.json's content). The folder is opened by Generator itself (the same checks of
    the config, the model and its caches: a bad folder raises what Generator raises), on a session whose segment
    keeps the model onnxruntime was given; LiteUnavailable names what this path does not serve."""
    from ..cpu_backend import _cpu_backend
    from ..generate import Generator
    from ..session import InferenceSession, SessionOptions

    cfg = read_config(folder)
    if not cfg.paged:
        raise LiteUnavailable("a GQA-layout model (no block_table input): the torch path serves it")
    if cfg.windowed_layers:
        raise LiteUnavailable("sliding-window layers (their ring caches): the torch path serves them")
    if (cfg.pagedkit.get("tensor_parallel") or {}).get("world_size", 1) != 1:
        raise LiteUnavailable("a tensor-parallel export")
    path = inside_folder(folder, cfg.filename, "model.decoder.filename", str(folder / GENAI_CONFIG))
    session = InferenceSession(str(path), SessionOptions(intra_op_num_threads=threads, keep_segment_sources=True),
                               providers=["CPUExecutionProvider"], cpu_backend=_cpu_backend(None, "auto"))
    gen = Generator(folder, threads=threads, max_seq_len=16, session=session)  # Generator's checks of the folder
    one = session.single_segment()
    if one is None:
        raise LiteUnavailable(f"the model is not one onnxruntime segment on the CPU (backend "
                              f"{session.cpu_backend}: {next(iter(session.delegated.get('torch') or {}), '')})")
    seg, report = one[0], session.delegated
    src = seg.source
    block_size = gen.state.mgr.config.groups[0].block_size
    del gen
    sub_inputs = {vi.name: vi for vi in src.model.graph.input}
    renames = {cfg.input(k): k for k in STEP_ROLES}
    roles, caches = {}, {}
    cache_names = {n for n in seg.inputs
                   if any(N.layer_of(n, past) is not None for past, _ in cfg.caches.values())}
    for name in seg.inputs:
        if name in cache_names:
            dims = _dims(sub_inputs[name])
            if len(dims) < 3 or not all(isinstance(d, int) and d > 0 for d in dims[2:]):
                raise LiteUnavailable(f"cache input {name!r}: dimensions {dims} (need [num_blocks, block_size, "
                                      "static ints...])")
            if isinstance(dims[1], int) and dims[1] != block_size:
                raise LiteUnavailable(f"cache input {name!r}: block size {dims[1]}, the model's is {block_size}")
            caches[name] = {"block_shape": [block_size] + dims[2:],
                            "dtype": dtypes.numpy_name(sub_inputs[name].type.tensor_type.elem_type)}
        elif name in renames:
            roles[STEP_ROLES[renames[name]]] = name
        elif name == ROWS_INPUT:
            roles["logit_rows"] = name
        else:
            raise LiteUnavailable(f"input {name!r}: not a step input this path makes, nor a cache")
    if "input_ids" not in roles or "block_table" not in roles or "cu_seqlens" not in roles:
        raise LiteUnavailable(f"the segment lacks a step input (it has {sorted(roles)})")
    logits = cfg.outputs.get(N.LOGITS) or N.LOGITS
    if logits not in seg.outputs or logits in seg.aliases or logits in seg.written:
        raise LiteUnavailable(f"the segment does not compute the logits output {logits!r}")
    types = {vi.name: vi.type.tensor_type.elem_type for vi in list(src.model.graph.input) + list(src.model.graph.output)}
    plan = {"version": PLAN_VERSION, "threads": threads, "spin": src.spin, "library": src.library,
            "external": src.external_dir is not None, "block_size": block_size,
            "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size, "eos_token_ids": cfg.eos_token_ids, "context_length": cfg.context_length,
            "roles": roles, "caches": caches, "logits": logits,
            "logits_dtype": dtypes.numpy_name(types[logits]),
            "step_dtypes": {r: dtypes.numpy_name(types[n]) for r, n in roles.items()},
            "aliases": dict(seg.aliases), "written": dict(seg.written),
            "delegation": {"lowered": len(report["lowered"]), "widened": report["widened"],
                           "fused": report["onnx_attention"]}}
    return src.model, plan


def write_plan(folder: Path, threads: int, out: Path) -> Path:
    """Build and write the plan to `out` (atomically: a temporary sibling renamed)."""
    folder = folder.resolve()
    model, plan = build_plan(folder, threads)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        in_folder = out.resolve().is_relative_to(folder / IN_FOLDER)
        if in_folder:  # large inline tensors (widened weights) beside it, mapped from the model folder
            location = str(out.resolve().relative_to(folder) / DATA_FILE)
            offset = 0
            with open(tmp / DATA_FILE, "wb") as f:
                for t in model.graph.initializer:
                    if uses_external_data(t) or len(t.raw_data) <= _INLINE_MAX:
                        continue
                    pad = (-offset) % 4096  # page-aligned: onnxruntime maps it
                    f.write(b"\0" * pad)
                    offset += pad
                    data = t.raw_data
                    f.write(data)
                    set_external_data(t, location, offset, len(data))
                    t.ClearField("raw_data")
                    offset += len(data)
            plan["external"] = plan["external"] or offset > 0
        (tmp / SEGMENT_FILE).write_bytes(model.SerializeToString())
        (tmp / PLAN_FILE).write_text(json.dumps(plan, indent=1))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _drop_stale(out, threads)
    return out


def _drop_stale(out: Path, threads: int) -> None:
    """Remove the other plans beside `out` made for the same thread count: their key no longer matches the folder,
    onnxruntime or pagedkit (each can hold the widened weights: hundreds of MB)."""
    for other in out.parent.iterdir():
        if other == out or not (other / PLAN_FILE).is_file():
            continue
        try:
            stale = json.loads((other / PLAN_FILE).read_text()).get("threads") == threads
        except (OSError, ValueError):
            stale = False
        if stale:
            shutil.rmtree(other, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkit.runtime.lite.compile", description=__doc__.splitlines()[0])
    p.add_argument("model_dir", type=Path, help=f"a model folder (model.onnx + {GENAI_CONFIG})")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--out", type=Path, required=True, help="the plan folder to write")
    args = p.parse_args(argv)
    try:
        out = write_plan(args.model_dir, max(1, args.threads), args.out)
    except Exception as exc:  # a refusal, or the folder's own error (what Generator raises on it)
        print(json.dumps({"refused": f"{type(exc).__name__}: {exc}" if not isinstance(exc, LiteUnavailable)
                          else str(exc)}))
        return 0
    print(json.dumps({"plan": str(out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
