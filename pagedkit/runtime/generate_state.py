"""The per-layout states of `Generator` (runtime/generate.py) and the helpers the engine shares with it:
- `_PagedState`: the paged layout: a KVCacheManager owns the caches; one plan per step; on a model that is one
  onnxruntime segment, after a first checked step, the direct path (the segment fed without run_torch's per-call
  checks, persistent step buffers, the logits in a buffer of the segment's, the LM head for the last row only);
- `_GQAState`: the GQA layout: caches [1, Hkv, past, D] grown step by step (present -> next past);
- `resolve_block_size`, `step_feeds`, `layer_cache_spec` (re-exported by generate.py, used by the engine).
The config these read is generate.DecoderConfig (not imported here: generate.py imports this module).
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch

from ..interface import dtypes
from ..interface import names as N
from ..validators.contract import CACHE_FORMATS
from .kv.cache import KVCacheManager
from .kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec

# ONNX type string of a cache input -> the cache dtype spelling of KVCacheConfig (uint8 -> int4)
_CACHE_DTYPE = {f.storage: name for name, f in CACHE_FORMATS.items()}


def _torch_type(type_str: str) -> torch.dtype:
    return dtypes.torch_dtype(type_str)


def resolve_block_size(cfg: "DecoderConfig", key_dims: Sequence, requested: int | None = None, who: str = "") -> int:
    """The block size of a paged model: `requested` (refused where the graph fixes another), else the graph's
    static dimension 1 of the first layer's key cache input (`key_dims`: its shape, ints or names), else
    genai_config's pagedkit block_size, else 16."""
    fixed = key_dims[1] if len(key_dims) > 1 and isinstance(key_dims[1], int) else None
    if requested and fixed and requested != fixed:
        key0 = cfg.name(N.past_names_key("key"), 0)
        raise ValueError(f"{who}block_size {requested}: the model's caches fix block_size {fixed} "
                         f"(input '{key0}' dimension 1); use {fixed}")
    return requested or fixed or cfg.block_size or 16


def step_feeds(plan, mgr: KVCacheManager, token_ids: Sequence[int] | torch.Tensor, renames: dict, input_names,
               input_ids_name: str) -> dict[str, torch.Tensor]:
    """The model inputs of one planned step of a paged model (token_ids: the plan's T tokens, batch order, or the
    input_ids tensor itself): the plan's step inputs under the model's names (`renames`), the caches and
    input_ids; only names in `input_names`."""
    feeds = {renames.get(k, k): v for k, v in plan.feeds(query_positions=True).items()}
    feeds = {k: v for k, v in feeds.items() if k in input_names}
    feeds |= {k: v for k, v in mgr.cache_feeds().items() if k in input_names}
    feeds[input_ids_name] = token_ids if isinstance(token_ids, torch.Tensor) else torch.tensor(
        list(token_ids), dtype=torch.int64, device=mgr.config.device)
    return feeds


def layer_cache_spec(cfg: "DecoderConfig", args: dict, i: int) -> LayerCacheSpec:
    """Layer i's cache spec from the session's inputs `args` (name -> NodeArg): dtype, KV heads, head size, scales."""
    key = args.get(cfg.name(N.past_names_key("key"), i))
    if key is None:
        raise ValueError(f"model has no cache input {cfg.name(N.past_names_key('key'), i)!r} for layer {i}")
    if key.type not in _CACHE_DTYPE:
        raise ValueError(f"input {key.name!r}: cache element type {key.type} is not a paged cache type")
    kv = key.shape[2] if len(key.shape) > 2 and isinstance(key.shape[2], int) else cfg.kv_num_heads
    layers = {int(l["layer"]): l for l in cfg.pagedkit.get("layers", [])}
    head = int(layers.get(i, {}).get("head_size", cfg.head_size))
    scales = {}
    for side in ("key", "value"):
        s = args.get(cfg.name(N.past_names_key(f"{side}_scale"), i))
        scales[side] = dtypes.numpy_name(dtypes.elem_type(s.type)) if s is not None else None  # float16 / 32
    return LayerCacheSpec(i, kv, head, _CACHE_DTYPE[key.type], scales["key"], scales["value"],
                          latent=cfg.name(N.past_names_key("value"), i) not in args)


class _PagedState:
    """The paged layout: a KVCacheManager owns the caches; one plan per step."""

    def __init__(self, gen: "Generator", block_size: int | None, num_blocks: int | None, shuffle_seed: int | None):
        cfg, sess = gen.config, gen.session
        args = {a.name: a for a in sess.get_inputs()}
        key0 = cfg.name(N.past_names_key("key"), 0)
        bs = resolve_block_size(cfg, args[key0].shape if key0 in args else [], block_size)
        self.max_seq_len = gen.max_seq_len
        chunk = max(1, min(cfg.chunk_size or bs, self.max_seq_len)) if cfg.windowed_layers else self.max_seq_len
        groups = []
        for windowed in (False, True):
            layers = [layer_cache_spec(cfg, args, i) for i in range(cfg.num_layers) if (i in cfg.windowed_layers) == windowed]
            if not layers:
                continue
            table = cfg.inputs.get(N.BLOCK_TABLE_WINDOWED if windowed else N.BLOCK_TABLE)
            per_seq = math.ceil(self.max_seq_len / bs)
            g = GroupConfig("windowed" if windowed else "full", 1, bs, tuple(layers),
                            window=cfg.window if windowed else None, chunk_tokens=chunk, table_name=table)
            n = num_blocks or (g.ring_blocks if windowed else per_seq) + 2
            groups.append(GroupConfig(g.name, n, bs, g.layers, g.window, chunk, table))
        names = {kind: past for kind, (past, _) in cfg.caches.items()}
        present = {kind: pres for kind, (_, pres) in cfg.caches.items()}
        self.mgr = KVCacheManager(KVCacheConfig(tuple(groups), max_batch_size=1, max_num_tokens=self.max_seq_len,
                                                max_seq_len=self.max_seq_len, device=str(gen.session.device),
                                                names=names, present_names=present))
        if hasattr(gen.session, "mirror_copies"):  # a tensor-parallel session: every rank makes the block copies
            gen.session.mirror_copies(self.mgr)
        if shuffle_seed is not None:  # block ids out of order and non-contiguous, as in a busy engine
            for pool in self.mgr.pools.values():
                free = list(pool.free)
                random.Random(shuffle_seed).shuffle(free)
                pool.free.clear()
                pool.free.extend(free)
        self.renames = {k: cfg.input(k) for k in N.STEP_INPUTS}
        self.input_names = set(args)
        self.gen = gen
        self.seq = 0
        self._direct = None  # the direct path after the first step (_setup_direct), or False

    def start(self, prompt: Sequence[int]) -> None:
        self.seq += 1
        self.mgr.add_sequence(self.seq, list(prompt))

    def step(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Run `ids` (chunked as the windowed rings need) -> their logits [len(ids), V], valid until the next step
        (on the direct path they live in a buffer the next step writes). last_only: the caller reads the last row
        only; where the model can compute the logits of chosen rows (kernels/cpu/logits.py), each chunk's last row
        alone is computed (a prefill skips the LM head of the other prompt tokens) and fewer rows come back."""
        mgr, sess = self.mgr, self.gen.session
        logits = []
        done = 0
        while done < len(ids):  # chunked so that windowed rings absorb each step
            n = min(len(ids) - done, mgr.max_step_tokens(self.seq))
            chunk = list(ids[done:done + n])
            plan = mgr.plan([(self.seq, chunk)])
            try:
                rows = n
                if self._direct:
                    out, rows = self._run_direct(plan, chunk, last_only)
                else:
                    feeds = step_feeds(plan, mgr, chunk, self.renames, self.input_names,
                                       self.gen.config.input(N.INPUT_IDS))
                    out = sess.run_torch(feeds, [self.gen.logits_name], plan=plan.hint,
                                         distinct_slots=True)[self.gen.logits_name]  # a manager plan: distinct slots
                    if self._direct is None:
                        self._direct = self._setup_direct(feeds)
            except BaseException:
                mgr.abort(plan)
                raise
            mgr.commit(plan)
            out = out if out.dim() == 2 and out.shape[0] == rows else out.reshape(rows, -1)
            done += n
            logits.append(out.clone() if self._direct and done < len(ids) else out)  # the next chunk reuses it
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def finish(self) -> None:
        self.mgr.free(self.seq)

    # ---- the direct path: a model that is one onnxruntime segment, fed without run_torch's per-call checks ----
    def _setup_direct(self, feeds: dict) -> tuple | bool:
        """After a first step through run_torch (its feed checks passed): when the whole model is one onnxruntime
        segment (InferenceSession.single_segment), the input list it takes with the caches in place, the
        positions of the per-step inputs and of the logits; else False. A decode step then skips run_torch's feed
        checks and the caches' lookups, and the segment binds nothing (the manager's step tensors and the id buffer
        are the same objects every step; the logits go to a buffer of the segment's: Segment.run keep)."""
        direct = self.gen.session.single_segment()
        if direct is None:
            return False
        from ..kernels.cpu.logits import ROWS_INPUT

        seg, names, outputs, constants = direct
        fixed = self.mgr.cache_feeds() | constants
        ins = [fixed.get(n) for n in names]
        step = [(n, i) for i, n in enumerate(names) if n not in fixed]
        if any(n not in feeds for n, _ in step) or self.gen.logits_name not in outputs:
            return False
        self._id_buf = torch.zeros(self.max_seq_len, dtype=torch.int64)
        self._id_np, self._ids = self._id_buf.numpy(), {}
        self._rows = None  # (its position, the model's default (every row), a one-row buffer and its numpy view)
        if ROWS_INPUT in names:
            last = torch.zeros(1, dtype=torch.int64)
            self._rows = (names.index(ROWS_INPUT), constants[ROWS_INPUT], last, last.numpy())
        return seg, ins, step, outputs.index(self.gen.logits_name)

    def _run_direct(self, plan, chunk: list[int], last_only: bool = False) -> tuple[torch.Tensor, int]:
        """(the chunk's logits, their rows: len(chunk), or 1 when only the last row was computed)."""
        seg, ins, step, logits = self._direct
        rows = len(chunk)
        if self._rows is not None:
            at, every, last, last_np = self._rows
            if last_only:
                last_np[0] = len(chunk) - 1
                ins[at], rows = last, 1
            else:
                ins[at] = every
        feeds = {self.renames.get(k, k): v for k, v in plan.feeds(query_positions=True).items()}
        n = len(chunk)
        ids = self._ids.get(n)  # views of one persistent id buffer, written through numpy (no torch op a step)
        if ids is None:
            ids = self._ids[n] = self._id_buf[:n]
        self._id_np[:n] = chunk
        feeds[self.gen.config.input(N.INPUT_IDS)] = ids
        for name, i in step:
            ins[i] = feeds[name]
        return seg.run(ins, keep=True)[logits], rows


class _GQAState:
    """The GQA layout: caches [1, Hkv, past, D] grown step by step (present -> next past)."""

    def __init__(self, gen: "Generator"):
        self.gen = gen
        self.args = {a.name: a for a in gen.session.get_inputs()}
        cfg = gen.config
        self.pairs = []  # (past input, present output)
        self.windowed = set()  # past inputs of windowed layers
        for i in range(cfg.num_layers):
            for side in ("key", "value"):
                past, present = cfg.name(N.past_names_key(side), i), cfg.name(N.present_names_key(side), i)
                if past in self.args:
                    self.pairs.append((past, present))
                    if cfg.window and i in cfg.windowed_layers:
                        self.windowed.add(past)
        self.window_capacity = int(cfg.window or 0) + cfg.window_slack

    def start(self, prompt: Sequence[int]) -> None:
        dev = self.gen.session.device
        self.past = {}
        for name, _ in self.pairs:
            a = self.args[name]
            kv = a.shape[1] if isinstance(a.shape[1], int) else self.gen.config.kv_num_heads
            d = a.shape[3] if isinstance(a.shape[3], int) else self.gen.config.head_size
            # windowed layers (sliding_window_cache=1) keep a fixed buffer of the window's capacity
            cap = self.window_capacity if name in self.windowed else 0
            self.past[name] = torch.zeros(1, kv, cap, d, dtype=_torch_type(a.type), device=dev)
        self.length = 0

    def step(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        cfg, sess, dev = self.gen.config, self.gen.session, self.gen.session.device
        n, total = len(ids), self.length + len(ids)
        feeds = dict(self.past)
        feeds[cfg.input(N.INPUT_IDS)] = torch.tensor([list(ids)], dtype=torch.int64, device=dev)
        mask = cfg.input(N.ATTENTION_MASK)
        if mask in self.args:
            feeds[mask] = torch.ones(1, total, dtype=_torch_type(self.args[mask].type), device=dev)
        pos = cfg.input(N.POSITION_IDS)
        if pos in self.args:
            feeds[pos] = torch.arange(self.length, total, device=dev).reshape(1, n).to(_torch_type(self.args[pos].type))
        names = [self.gen.logits_name] + [p for _, p in self.pairs]
        out = sess.run_torch(feeds, names)
        self.past = {past: out[present] for past, present in self.pairs}
        self.length = total
        return out[self.gen.logits_name].reshape(n, -1)

    def finish(self) -> None:
        self.past = {}


__all__ = ["layer_cache_spec", "resolve_block_size", "step_feeds"]
