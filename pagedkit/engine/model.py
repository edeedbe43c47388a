"""The engine's model: an InferenceSession over a paged model folder and the KVCacheManager that owns
its caches, sized for a batch (max_batch_size sequences, max_num_tokens tokens a step).

Cache geometry (same rules as generate.Generator): block_size is the graph's static cache dimension 1
if it has one, else the argument, else genai_config's block size, else 16. Pools:
- "full" group (full-attention layers, `block_table`): num_blocks blocks, default max_batch_size x
  ceil(max_seq_len / block_size) (every running sequence can reach the context length) capped by a fraction
  of the memory the device has free once the session holds its weights (and the windowed rings are
  counted): GPU_MEMORY_FRACTION of the free GPU memory on CUDA, CPU_MEMORY_FRACTION of the available RAM
  (MemAvailable) on the CPU, or `memory_fraction`; so a long context or a large batch takes what the device
  has and the engine preempts when it runs out (`pool_summary()` says what was chosen and why);
- "windowed" group (sliding-window layers, `block_table_windowed`): one ring per running sequence,
  max_batch_size x ring_blocks, rings sized for prefill chunks of chunk = genai search.chunk_size or
  block_size tokens (each step of a sequence is cut to KVCacheManager.max_step_tokens).
Prefix caching needs full-attention groups only; with a windowed group it is off (`prefix_caching`
False and `prefix_caching_off_reason` says why).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import torch

from ..interface import names as N
from ..interface.paths import inside_folder
from ..validators.contract import block_size_error
from ..runtime.generate import DecoderConfig, layer_cache_spec, read_config, resolve_block_size, step_feeds
from ..runtime.distributed.launch import TensorParallel, resolve_world
from ..runtime.kv.cache import KVCacheManager
from ..runtime.kv.config import GroupConfig, KVCacheConfig
from ..runtime.kv.plan import StepPlan
from ..runtime.kv.staging import PinnedRing
from ..runtime.ops import moe as moe_op
from ..runtime.ops.moe import EXPERT_WEIGHT_INPUTS
from ..runtime.session import ROWS_INPUT, InferenceSession, _cpu_backend
from .graphs import DecodeGraphs
from .prefill_graphs import MAX_TOKENS as PREFILL_GRAPH_TOKENS, PrefillGraphs


GPU_MEMORY_FRACTION = 0.9  # of the free GPU memory the default full-attention pool may take
CPU_MEMORY_FRACTION = 0.25  # of the available RAM the default full-attention pool may take on the CPU


def available_ram() -> int | None:
    """Bytes of RAM available to new allocations without swapping: /proc/meminfo's MemAvailable (Linux),
    else psutil's, else None (unknown: the pool is then sized for the batch alone)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def free_memory(device: torch.device) -> tuple[int | None, str, float]:
    """(bytes the device has free, what they are, the default fraction of them the pool may take)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "free GPU memory", GPU_MEMORY_FRACTION
    return available_ram(), "available RAM", CPU_MEMORY_FRACTION


def block_bytes(layers, block_size: int) -> int:
    """Bytes one block of a group holds over its layers: K (and V) codes and any scale caches."""
    total = 0
    for spec in layers:
        for shape, dtype in spec.shapes(1, block_size).values():
            total += math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return total


def pool_blocks(free_bytes: int, fraction: float, bytes_per_block: int, cap: int) -> int:
    """Blocks of the full-attention pool that `fraction` of `free_bytes` holds, at most `cap`; >= 1."""
    if not 0 < fraction <= 1:
        raise ValueError(f"Engine: memory_fraction must be in (0, 1], got {fraction!r}")
    return max(1, min(cap, int(free_bytes * fraction) // max(1, bytes_per_block)))


class PagedModel:
    def __init__(self, model_dir: str | Path, device: str, *, max_batch_size: int, max_num_tokens: int,
                 num_blocks: int | None, block_size: int | None, enable_prefix_caching: bool,
                 cuda_graphs: bool | None = None, memory_fraction: float | None = None, tp: int | None = None,
                 prefill_graph_tokens: int = PREFILL_GRAPH_TOKENS):
        for name, v in (("max_batch_size", max_batch_size), ("max_num_tokens", max_num_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Engine: {name} must be an integer >= 1, got {v!r}")
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
            raise ValueError(f"Engine: num_blocks must be an integer >= 1 or None (sized for the batch), got {num_blocks!r}")
        mf = memory_fraction
        if mf is not None and (isinstance(mf, bool) or not isinstance(mf, (int, float)) or not 0 < mf <= 1):
            raise ValueError(f"Engine: memory_fraction must be a number in (0, 1] or None (the device's default), "
                             f"got {memory_fraction!r}")
        if block_size is not None and block_size_error(block_size):
            raise ValueError(f"Engine: block_size: {block_size_error(block_size)}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"Engine: device must be 'cpu' or 'cuda', got {device!r}")
        if cuda_graphs not in (None, True, False, "padded"):
            raise ValueError(f"Engine: cuda_graphs must be None (on for CUDA), True, False or 'padded', got "
                             f"{cuda_graphs!r}")
        if cuda_graphs is True and device != "cuda":
            raise ValueError(f"Engine: cuda_graphs=True needs device 'cuda' (CUDA graphs), got device {device!r}")
        self.config: DecoderConfig = read_config(model_dir)
        cfg = self.config
        if not cfg.paged:
            raise ValueError(
                f"{model_dir}: the engine needs the paged layout (a '{N.BLOCK_TABLE}' decoder input); this model "
                f"has the GQA layout (inputs {sorted(cfg.inputs)}): rewrite it with paged-rewrite, or run it "
                "with pagedkit.runtime.generate.Generator")
        providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        path = inside_folder(model_dir, cfg.filename, "model.decoder.filename", str(Path(model_dir) / "genai_config.json"))
        self.tp = None
        world = resolve_world(model_dir, tp, "Engine: ")
        if world > 1:  # this process is rank 0 of a set it starts (runtime/distributed): eager steps only
            if cuda_graphs not in (None, False):
                raise ValueError("Engine: cuda_graphs with tensor parallelism is not built yet (each rank would "
                                 "capture its own graphs in lockstep); leave cuda_graphs None or False")
            cuda_graphs = False
            self.tp = TensorParallel(world, device)
            try:
                self.session = self.tp.session(model_dir, cpu_backend=_cpu_backend(None, "auto"))
            except BaseException:
                self.tp.close()
                raise
        else:
            self.session = InferenceSession(str(path), None, providers=providers,
                                            cpu_backend=_cpu_backend(None, "auto"))
        self.max_seq_len = cfg.context_length
        names = getattr(self.session, "node_names", None)  # a tensor-parallel set runs eagerly: no graphs
        self.moe_nodes = names(set(EXPERT_WEIGHT_INPUTS)) if names is not None else []
        over = {a.name for a in self.session.get_overridable_initializers()} if self.tp is None else set()
        self.rows = _RowFeed(self.session.device) if ROWS_INPUT in over else None  # the LM head on the rows read
        self.logits_name = cfg.outputs.get(N.LOGITS) or N.LOGITS
        args = {a.name: a for a in self.session.get_inputs()}
        key0 = cfg.name(N.past_names_key("key"), 0)
        bs = resolve_block_size(cfg, args[key0].shape if key0 in args else [], block_size, who="Engine: ")
        self.block_size = bs
        chunk = max(1, min(cfg.chunk_size or bs, self.max_seq_len))
        groups = []
        for windowed in (False, True):
            layers = [layer_cache_spec(cfg, args, i) for i in range(cfg.num_layers)
                      if (i in cfg.windowed_layers) == windowed]
            if not layers:
                continue
            table = cfg.inputs.get(N.BLOCK_TABLE_WINDOWED if windowed else N.BLOCK_TABLE)
            g = GroupConfig("windowed" if windowed else "full", 1, bs, tuple(layers),
                            window=cfg.window if windowed else None, chunk_tokens=chunk, table_name=table)
            n = max_batch_size * g.ring_blocks if windowed else (
                num_blocks or max_batch_size * math.ceil(self.max_seq_len / bs))
            groups.append(dataclasses.replace(g, num_blocks=n))
        self.pool_sizing = "num_blocks" if num_blocks else "max_batch_size x context"
        free, where, fraction = (None, "", 0.0) if num_blocks else free_memory(self.session.device)
        if free is not None:
            fraction = memory_fraction or fraction
            ring_bytes = sum(g.num_blocks * block_bytes(g.layers, bs) for g in groups if g.window is not None)
            groups = [dataclasses.replace(g, num_blocks=pool_blocks(free - ring_bytes, fraction,
                                                                    block_bytes(g.layers, bs), g.num_blocks))
                      if g.window is None else g for g in groups]
            self.pool_sizing = f"{where} x {fraction} (capped at max_batch_size x context)"
        self.prefix_caching_off_reason = None
        if not enable_prefix_caching:
            self.prefix_caching_off_reason = "enable_prefix_caching=False"
        elif any(g.windowed for g in groups):
            self.prefix_caching_off_reason = "the model has sliding-window layers (their ring blocks are recycled)"
        self.prefix_caching = self.prefix_caching_off_reason is None
        graphs = device == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.mgr = KVCacheManager(KVCacheConfig(
            tuple(groups), max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
            max_seq_len=self.max_seq_len, device=str(self.session.device), prefix_caching=self.prefix_caching,
            pad_block=graphs,
            names={k: past for k, (past, _) in cfg.caches.items()},
            present_names={k: pres for k, (_, pres) in cfg.caches.items()}))
        if self.tp is not None:
            self.session.mirror_copies(self.mgr)  # copy-on-write of shared blocks made on every rank's caches
        self.groups = {g.name: g for g in groups}
        self.renames = {k: cfg.input(k) for k in N.STEP_INPUTS}
        self.input_names = set(args)
        # copy to the device only the step inputs the model reads (one merged copy a decode step, kv/plan.py)
        self.mgr.feed_only({k for k in self.mgr.step_input_names() if self.renames.get(k, k) in self.input_names})
        self.input_ids_name = cfg.input(N.INPUT_IDS)
        self.graphs = DecodeGraphs(self, capture=cuda_graphs != "padded") if graphs else None
        self.prefill_graphs = None  # first prompts as replays (prefill_graphs.py), where the model allows them
        self.prefill_graphs_off_reason = self._prefill_graphs_off(prefill_graph_tokens)
        if self.prefill_graphs_off_reason is None:
            self.prefill_graphs = PrefillGraphs(self, self.graphs.runs, capture=self.graphs.capture,
                                                max_tokens=prefill_graph_tokens)

    def _prefill_graphs_off(self, max_tokens) -> str | None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise ValueError(f"Engine: prefill_graph_tokens must be an integer >= 0 (0: off), got {max_tokens!r}")
        if not max_tokens:
            return "prefill_graph_tokens=0"
        if self.graphs is None:
            return "no CUDA graphs (cuda_graphs off, or not CUDA)"
        if self.rows is None:
            return f"the model's head has no '{ROWS_INPUT}' input (its logits are not [tokens, vocab])"
        if any(g.windowed for g in self.groups.values()):
            return "the model has sliding-window layers"
        return None  # MoE layers: each key's first (eager) step shows whether they can be captured (host_routes)

    def host_routes(self) -> str | None:
        """Why the step just run cannot be captured: a MoE node whose last call took a path that reads the host
        (runtime/ops/moe.py: its grouped path, where the fused Triton kernel does not serve the node); None when
        every MoE node ran on the device (the fused kernel, or the small-batch paths)."""
        for name in self.moe_nodes:
            route = moe_op.ROUTES.get(name)
            if route in moe_op.HOST_ROUTES:
                return (f"MoE node {name!r} took its {route} path, which reads per-expert counts on the host "
                        f"(not capturable; the fused kernel did not serve it: {moe_op.REFUSED.get(name, '?')})")
        return None

    def pool_summary(self) -> str:
        """One line: each pool's blocks, tokens and bytes, and the rule that sized the full-attention pool."""
        parts = []
        for g in self.groups.values():
            size = g.num_blocks * block_bytes(g.layers, g.block_size)
            ring = f" (rings of {g.ring_blocks})" if g.windowed else ""
            parts.append(f"{g.name} {g.num_blocks} blocks{ring} x {g.block_size} tokens = "
                         f"{g.num_blocks * g.block_size} tokens, {size / 2 ** 20:.1f} MiB")
        return f"KV cache: {'; '.join(parts)}; sized by {self.pool_sizing}"

    def close(self) -> None:
        """Stop the tensor-parallel followers, if any (the session stays usable only without them)."""
        if self.tp is not None:
            self.tp.close()

    def blocks_needed(self, num_tokens: int) -> dict[str, int]:
        """Blocks of each group one sequence of num_tokens cached tokens holds."""
        return {name: (g.ring_blocks if g.windowed else math.ceil(num_tokens / g.block_size))
                for name, g in self.groups.items()}

    def feeds(self, plan: StepPlan, token_ids: Sequence[int], input_names=None) -> dict[str, torch.Tensor]:
        """The model inputs of one planned step (token_ids: the plan's T tokens, batch order): the plan's step
        inputs under the model's names, the caches, input_ids; only names in `input_names` (default: the
        session's inputs)."""
        return step_feeds(plan, self.mgr, token_ids, self.renames,
                          self.input_names if input_names is None else input_names, self.input_ids_name)

    def forward(self, feeds: dict[str, torch.Tensor], hint: str | None) -> torch.Tensor:
        """The logits of one step's feeds through the session (hint: the plan kind, StepPlan.hint). The feeds come
        from the manager's plans, whose write slots are distinct (pad rows write only the pad block)."""
        return self.session.run_torch(feeds, [self.logits_name], plan=hint, distinct_slots=True)[self.logits_name]

    def plan(self, batch: Sequence[tuple]) -> StepPlan:
        """One step's plan for batch [(seq_id, token ids)]: a decode step CUDA graphs serve is padded to its
        batch bucket with replay-wide bounds (graphs.py), a step of first prompts a prefill graph serves to its
        token bucket (prefill_graphs.py); anything else is the manager's plain plan."""
        if self.prefill_graphs is not None:
            plan = self.prefill_graphs.plan(batch)
            if plan is not None:
                return plan
        return self.graphs.plan(batch) if self.graphs is not None else self.mgr.plan(batch)

    def run(self, plan: StepPlan, token_ids: Sequence[int], rows: Sequence[int] | None = None,
            device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one planned step (token_ids: the plan's T tokens, batch order); the logits of the flat
        token positions `rows` (all T when None) as [len(rows), V] on the run device in the model's logits
        dtype (a decode step CUDA graphs serve: a replay). device_ids: the step's ids as a [T] int64 tensor on
        the run device (a decode step graphs serve only; token_ids then only gives T). The caller commits (on
        an exception here the plan is aborted before re-raising)."""
        mgr = self.mgr
        rows = None if rows is None or list(rows) == list(range(len(token_ids))) else list(rows)  # None: every row
        try:
            if self.graphs is not None and self.graphs.serves(plan):
                out = self.graphs.run(plan, token_ids, device_ids)
            elif device_ids is not None:
                raise ValueError("PagedModel.run: device_ids need a decode step CUDA graphs serve (graphs.plan)")
            elif self.prefill_graphs is not None and self.prefill_graphs.serves(plan):
                return self.prefill_graphs.run(plan, token_ids, rows)
            else:
                feeds = self.feeds(plan, token_ids)
                if self.rows is not None and rows is not None:
                    # the LM head on the rows read only (a middle prompt chunk reads none: one row computed)
                    feeds[ROWS_INPUT] = self.rows.feed(rows or [len(token_ids) - 1])
                    return self.forward(feeds, plan.hint).reshape(max(len(rows), 1), -1)[:len(rows)]
                out = self.forward(feeds, plan.hint)
        except BaseException:
            if self.graphs is not None:
                self.graphs.abort(plan)
            if self.prefill_graphs is not None:
                self.prefill_graphs.abort(plan)
            mgr.abort(plan)
            raise
        out = out.reshape(len(token_ids), -1)
        if rows is not None:
            out = out.index_select(0, torch.tensor(rows, dtype=torch.int64, device=out.device))
        return out


class _RowFeed:
    """The `pagedkit.logit_rows` feed of a step (runtime/fuse.py's `logit_rows`, or the CPU onnxruntime path's
    kernels/cpu/logits.py): row indices [R] int64 on the session's device, copied from a pinned ring without
    blocking the host (CUDA) into a persistent buffer that grows to the largest R seen."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.ring: PinnedRing | None = None
        self.buf: torch.Tensor | None = None

    def feed(self, rows: list[int]) -> torch.Tensor:
        n = len(rows)
        if not self.cuda:
            return torch.tensor(rows, dtype=torch.int64)
        if self.buf is None or self.buf.numel() < n:
            size = max(n, 64, 2 * (self.buf.numel() if self.buf is not None else 0))
            self.ring = PinnedRing.of(size, torch.int64, cuda=True)
            self.buf = torch.empty(size, dtype=torch.int64, device=self.device)
        host = self.ring.take()
        host[:n] = torch.tensor(rows, dtype=torch.int64)
        self.buf[:n].copy_(host[:n], non_blocking=True)
        self.ring.done()
        return self.buf[:n]
