"""Streaming checkpoints: a Hugging Face model on the meta device whose parameters read themselves from the
safetensors files of a checkpoint folder, one tensor (or a slice of one) at a time, when the export writes them.

`streamed_model(folder, config, dtype)` is what `from_pretrained(folder, config=config, dtype=dtype)` would return
without reading a byte: the same module tree (built on the meta device), every parameter and persistent buffer a
`LazyTensor` (lazy.py) of the dtype from_pretrained gives it (its `_keep_in_fp32_modules` plan included) whose
value is read from the file(s) when evaluated — and whose row ranges are read alone (`slicing.narrow`), so that
the exporter writes an initializer in chunks. Checkpoint keys map to parameters the way transformers maps them
(its conversion mapping: renamings, and per-expert MoE tensors merged into one [E, ...] parameter —
`MergeModulelist` / `Concatenate`, recorded as lazy `stack` / `cat` over one LazyTensor per expert; experts past
a shrunk config's count are skipped). Checkpoint forms read here besides plain tensors:
- DeepSeek-V3's FP8 release: a float8_e4m3fn `weight` with a float32 `weight_scale_inv` per 128 x 128 block (the
  config's `quantization_config.weight_block_size`), dequantized as DeepSeek's `weight_dequant` does
  (float32 product, then the parameter's dtype), 128-row block by block;
- GPTQ / AWQ int4 (`qweight` / `qzeros` / `scales` / `g_idx`): prequant.py (the graph gets MatMulNBits).
A parameter the checkpoint lacks is an error naming it (from_pretrained would initialize it randomly).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from .lazy import LazyTensor

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# quantization_config.quant_method values read here (others, e.g. GPT-OSS's mxfp4, go through from_pretrained)
STREAMED_QUANT_METHODS = ("fp8", "gptq", "awq")


class CheckpointIndex:
    """Which file of a (sharded) safetensors checkpoint holds each tensor, and readers of tensors / row ranges."""

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: self.folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            self.where = {}
            for f in sorted(self.folder.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    self.where.update({k: f for k in h.keys()})
        self._meta: dict[str, tuple[list[int], str]] = {}

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def keys(self):
        return self.where.keys()

    def info(self, key: str) -> tuple[list[int], str]:
        """(shape, safetensors dtype name) of `key`, from its file's header (each header read once)."""
        if key not in self._meta:
            import struct

            with open(self.where[key], "rb") as f:
                header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
            self._meta.update({k: (list(v["shape"]), v["dtype"]) for k, v in header.items() if k != "__metadata__"})
        return self._meta[key]

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor `key` (or its rows [start, stop)), in its stored dtype; the file is mapped only meanwhile."""
        from safetensors import safe_open

        with safe_open(str(self.where[key]), "pt") as h:  # both give a tensor of its own (one copy)
            if rows is None:
                return h.get_tensor(key)
            return h.get_slice(key)[rows[0]:rows[1]]


def fp8_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   row0: int = 0) -> torch.Tensor:
    """w (rows row0.. of an FP8 weight) times the scale of its block (scale_inv: the block rows from row0 // block
    on), computed in float32 and then rounded to `dtype` (DeepSeek's weight_dequant), one block row at a time."""
    br, bc = block
    out = torch.empty(w.shape, dtype=dtype)
    cols = torch.arange(w.shape[1]) // bc
    base = row0 // br
    for i in range(0, w.shape[0], br):
        rows = (torch.arange(i, min(i + br, w.shape[0])) + row0) // br - base
        s = scale_inv.to(torch.float32)[rows][:, cols]
        out[i:i + len(rows)] = (w[i:i + len(rows)].to(torch.float32) * s).to(dtype)
    return out


READ_BYTES = 64 << 20  # a tensor converted on reading is read this many bytes of rows at a time


class _Reader:
    """Reads one checkpoint tensor (or its rows) as `dtype`: plain, or FP8 block-dequantized when a
    `{key}_scale_inv` exists. A conversion is done READ_BYTES of rows at a time into the result, so that reading
    holds the result and one slice of the stored tensor, never two whole copies."""

    def __init__(self, index: CheckpointIndex, key: str, dtype: torch.dtype, fp8_block: tuple[int, int] | None):
        self.index, self.key, self.dtype = index, key, dtype
        self.scale_key = key + "_scale_inv" if key + "_scale_inv" in index else None
        if self.scale_key is not None and fp8_block is None:
            fp8_block = (128, 128)  # DeepSeek-V3's, when the config does not say
        self.block = fp8_block

    def __call__(self, rows: tuple[int, int] | None = None) -> torch.Tensor:
        shape, stored = self.index.info(self.key)
        a, b = rows if rows is not None else (0, shape[0] if shape else 0)
        fp8 = self.scale_key is not None and stored.startswith("F8")
        if not shape or (not fp8 and _ST_DTYPES.get(stored) == self.dtype):
            return self.index.read(self.key, rows)  # no conversion: one read
        out = torch.empty([b - a] + shape[1:], dtype=self.dtype)
        row_bytes = max(1, math.prod(shape[1:]) * 4)
        step = max(1, READ_BYTES // row_bytes)
        if fp8:
            step = max(self.block[0], step // self.block[0] * self.block[0])
        r = a
        while r < b:
            stop = min(b, (r // step + 1) * step)  # block-aligned chunks: each reads its scale rows once
            w = self.index.read(self.key, (r, stop))
            if fp8:
                first, last = r // self.block[0], -(-stop // self.block[0])
                out[r - a:stop - a] = fp8_dequantize(w, self.index.read(self.scale_key, (first, last)), self.block,
                                                     self.dtype, r)
            else:
                out[r - a:stop - a] = w.to(self.dtype)
            del w
            r = stop
        return out


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def leaf(meta: torch.Tensor, read: Callable[..., torch.Tensor]) -> LazyTensor:
    """A LazyTensor of `meta`'s shape / dtype whose value is read(); rows (dim 0) alone through read((a, b))."""
    def slicer(dim: int, a: int, b: int):
        return read((a, b)) if dim == 0 else None

    return LazyTensor(meta.detach().to("meta"), read, slicer)


def _conversions(model):
    """transformers' (renamings, converters) for this model: how checkpoint keys become parameter names."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return ([m for m in mapping if isinstance(m, WeightRenaming)],
            [m for m in mapping if isinstance(m, WeightConverter)])


def _merged(meta: torch.Tensor, converter, parts: dict[str, list[tuple[int, LazyTensor]]], name: str) -> LazyTensor:
    """The LazyTensor of a converter's target: its operations replayed lazily over the per-expert leaves."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    values: list = []
    count = meta.shape[0]
    for pattern in converter.source_patterns:
        got = sorted(parts.get(pattern) or [], key=lambda e: e[0])
        missing = sorted(set(range(count)) - {i for i, _ in got})
        if missing:
            raise ValueError(f"{name}: the checkpoint has no {pattern!r} tensor for expert(s) {missing[:8]} "
                             f"(of {count})")
        values.append([t for _, t in got])
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            values = [torch.stack(v, dim=op.dim) if isinstance(v, list) else v for v in values]
        elif isinstance(op, Concatenate):
            values = [torch.cat(values, dim=op.dim)]
        else:
            raise NotImplementedError(f"{name}: transformers converts its checkpoint tensors with "
                                      f"{type(op).__name__}, which streaming export does not replay")
    if len(values) != 1 or tuple(values[0].shape) != tuple(meta.shape):
        raise ValueError(f"{name}: the checkpoint's tensors merge to {tuple(values[0].shape)}, the model expects "
                         f"{tuple(meta.shape)}")
    return values[0].to(meta.dtype) if values[0].dtype != meta.dtype else values[0]


def _index_of(key: str, pattern: str) -> int:
    """The expert number a '*' of `pattern` matches in `key` (0 when the pattern has none)."""
    body = re.escape(pattern).replace(r"\*", r"(\d+)")
    m = re.search(body, key)
    return int(m.group(1)) if m and m.groups() else 0


def _dtype_plan(model, dtype: torch.dtype) -> Callable[[str], torch.dtype | None]:
    """name -> the dtype from_pretrained forces on it (`_keep_in_fp32_modules[_strict]`), or None."""
    from transformers.core_model_loading import build_glob_alternation

    plan = model._get_dtype_plan(dtype) if hasattr(model, "_get_dtype_plan") else {}
    if not plan:
        return lambda name: None
    alt, groups, _ = build_glob_alternation(list(plan))

    def forced(name: str) -> torch.dtype | None:
        m = alt.search(name)
        return plan[groups[m.lastgroup]] if m is not None else None
    return forced


def checkpoint_tensors(model, folder: str | Path, dtype: torch.dtype | None = None
                       ) -> dict[str, LazyTensor]:
    """full parameter / buffer name -> a LazyTensor reading it from the checkpoint in `folder` (see the module
    doc). `dtype`: the dtype the model was built in (from_pretrained's `dtype`), for its fp32 plan."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    from . import prequant

    index = CheckpointIndex(folder)
    config = getattr(model, "config", None)
    qcfg = getattr(config, "quantization_config", None) or {}
    qcfg = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
    block = tuple(qcfg.get("weight_block_size") or ()) or None
    renamings, converters = _conversions(model)
    meta = dict(model.state_dict(keep_vars=True))
    forced = _dtype_plan(model, dtype) if dtype is not None else (lambda name: None)
    prefix = getattr(model, "base_model_prefix", None)
    pattern_of = {p: c for c in converters for p in c.source_patterns}
    direct: dict[str, str] = {}
    grouped: dict[str, dict[str, list[tuple[int, str]]]] = {}
    for key in sorted(index.keys(), key=dot_natural_key):
        new, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if new not in meta and key in meta:
            new, pattern = rename_source_key(key, [], [], prefix, meta)
        if new not in meta:
            continue  # scales, layers / experts past a shrunk config, tensors the model does not have
        if pattern is None:
            direct.setdefault(new, key)
        else:
            grouped.setdefault(new, {}).setdefault(pattern, []).append((_index_of(key, pattern), key))
    out: dict[str, LazyTensor] = {}
    experts = _expert_count(config)
    for name, t in meta.items():
        want = forced(name) or t.dtype
        m = t.detach().to("meta").to(want)
        if name in direct:
            out[name] = leaf(m, _fitted(index, direct[name], m, _Reader(index, direct[name], want, block), experts))
        elif name in grouped:
            conv = pattern_of[next(iter(grouped[name]))]
            count = t.shape[0]
            parts = {}
            for pattern, keys in grouped[name].items():
                keys = [(i, k) for i, k in keys if i < count]
                shape = index.info(keys[0][1])[0] if keys else None
                parts[pattern] = [(i, leaf(torch.empty(shape, dtype=want, device="meta"),
                                          _Reader(index, k, want, block))) for i, k in keys]
            out[name] = _merged(m, conv, parts, name)
        else:
            q = prequant.quantized_leaf(index, name, m, qcfg)
            if q is not None:
                out[name] = q
    return out


def _expert_count(config) -> int | None:
    """The routed experts of a (possibly shrunk, --num-experts) config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_local_experts", "n_routed_experts", "num_experts"):
        if getattr(text, key, None):
            return int(getattr(text, key))
    return None


def _fitted(index: CheckpointIndex, key: str, meta: torch.Tensor, read: Callable, experts: int | None) -> Callable:
    """`read`, or for a tensor with one row per expert of a checkpoint with more experts than the (shrunk) model
    (a router [E, H], a correction bias [E], fused experts [E, ...]) a reader of the first rows only."""
    shape = index.info(key)[0]
    if shape == list(meta.shape):
        return read
    if experts is not None and shape[1:] == list(meta.shape[1:]) and meta.shape[0] == experts < shape[0]:
        n = experts
        return lambda rows=None: read(rows if rows is not None else (0, n))
    raise ValueError(f"{key}: the checkpoint holds {shape}, the model expects {list(meta.shape)}")


def install(model, tensors: dict[str, LazyTensor], folder) -> list:
    """Put `tensors` in place of the model's parameters / buffers (tied parameters: one object under every
    name); a parameter with no tensor raises KeyError naming it. Returns what was replaced, for `restore`."""
    swapped, made = [], {}
    named = [(n, t, "_parameters") for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, "_buffers") for n, t in model.named_buffers(remove_duplicate=False)]
    for full, t, _ in named:  # tied parameters read the first of their names the checkpoint has
        if t is not None and id(t) not in made and full in tensors:
            made[id(t)] = tensors[full]
    for full, t, table in named:
        if t is None:
            continue
        if id(t) not in made:
            if table == "_buffers":
                continue  # computed buffers (rotary frequencies) are not in checkpoints
            raise KeyError(f"{folder}: the checkpoint has no tensor {full!r} (nor a form pagedkit reads: "
                           "per-expert tensors, FP8 with weight_scale_inv, GPTQ / AWQ qweight)")
        owner, _, attr = full.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        swapped.append((module, table, attr, getattr(module, table)[attr]))
        getattr(module, table)[attr] = made[id(t)]
    return swapped


def restore(swapped: list) -> None:
    for module, table, attr, t in swapped:
        getattr(module, table)[attr] = t


def meta_model(config, dtype: torch.dtype):
    """The transformers model of `config` on the meta device (no memory), as from_pretrained builds it."""
    from transformers import AutoModelForCausalLM

    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval()


def _generation_config(model, folder: Path) -> None:
    """model.generation_config as from_pretrained sets it: generation_config.json, else from config.json."""
    from transformers import GenerationConfig

    if not model.can_generate():
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True, _from_auto=True)
    except OSError:
        model.generation_config = GenerationConfig.from_pretrained(
            folder, config_file_name="config.json", local_files_only=True, _from_auto=True, _from_model_config=True)


def streamed_model(folder: str | Path, config, dtype: torch.dtype):
    """from_pretrained(folder, config=config, dtype=dtype) with every weight a lazy reader (module doc)."""
    model = meta_model(config, dtype)
    install(model, checkpoint_tensors(model, folder, dtype), folder)
    _generation_config(model, Path(folder))
    return model


def nbytes(t: torch.Tensor) -> int:
    return math.prod(t.shape) * t.element_size()


@contextlib.contextmanager
def checkpoint_parameters(model: torch.nn.Module, folder) -> Iterator[torch.nn.Module]:
    """Within the block, every parameter and buffer of `model` (typically built on the meta device: no memory)
    that the safetensors checkpoint in `folder` holds is a LazyTensor reading that one tensor from the file when
    evaluated (single file or sharded with model.safetensors.index.json), cast to the model's dtype, its rows
    readable alone (slicing.py). Checkpoint keys map to parameters as transformers maps them (renamings,
    per-expert MoE tensors merged into [E, ...] parameters), FP8 block-quantized and GPTQ / AWQ forms included
    (checkpoint.py). Tied parameters (one object under two names) read the first name the checkpoint has. A
    parameter the checkpoint does not hold raises KeyError naming it."""
    swapped = install(model, checkpoint_tensors(model, folder), folder)
    try:
        yield model
    finally:
        restore(swapped)
