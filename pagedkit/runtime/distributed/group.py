"""The process group of a tensor-parallel set, as the collective ops see it (runtime/ops/collectives.py).

One set per process at a time: `init` joins it (torch.distributed's default group: NCCL on CUDA, gloo on the CPU,
every collective bounded by `timeout`) plus a gloo "control" group that carries the step messages rank 0
broadcasts (messages.py); its timeout is long, because a follower waits there while the server is idle. A rank
that dies closes its connections: a collective waiting on it fails at once (gloo: "Connection closed by peer"); a
rank that hangs makes the others' next collective fail after `timeout` (gloo raises; NCCL's watchdog aborts the
process, which its peers then see die).

All-reduce sums a copy of its input (the input is never written); all-gather concatenates along an axis. Both
run on the caller's CUDA stream with NCCL, with no host synchronization: a CUDA-graph capture records them
(NCCL >= 2.9.6; not run on a GPU yet, tests/test_tp_gpu.py).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ... import settings

CONTROL_TIMEOUT = datetime.timedelta(days=7)  # a follower waits for the next step this long (an idle server)


class TPError(RuntimeError):
    """A tensor-parallel set failed: a rank died, timed out or raised; the message is one line naming it."""


@dataclass
class Group:
    rank: int
    world: int
    device: torch.device
    timeout: float  # seconds, every collective of the compute group
    store: object  # the torch.distributed store the set met through (errors and status of the followers)
    control: object  # gloo group of the step messages (CPU tensors)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y)
        return y

    def all_gather(self, x: torch.Tensor, axis: int) -> torch.Tensor:
        x = x.contiguous()
        axis %= max(1, x.dim())
        out = torch.empty((self.world * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_single(out, x)  # [world * rows, ...]: the ranks' tensors one after the other on axis 0
        if axis == 0:
            return out
        out = out.reshape((self.world,) + tuple(x.shape)).movedim(0, axis)
        return out.flatten(axis, axis + 1)


_ACTIVE: Group | None = None


def timeout_seconds(value: float | None = None) -> float:
    """The collective timeout: `value`, else PAGEDKIT_TP_TIMEOUT."""
    t = settings.read("PAGEDKIT_TP_TIMEOUT") if value is None else float(value)
    if not t > 0:
        raise ValueError(f"tensor-parallel timeout: expected seconds > 0, got {t!r}")
    return t


def init(rank: int, world: int, store_path: str, device: str | torch.device, timeout: float) -> Group:
    """Join the set of `world` ranks meeting at the FileStore `store_path` as `rank` (blocks until all have
    joined, at most `timeout`)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise TPError("this process already belongs to a tensor-parallel set (one at a time): close it first")
    device = torch.device(device)
    store = dist.FileStore(store_path, world)
    kwargs = dict(backend="nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world,
                  timeout=datetime.timedelta(seconds=timeout))
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _ACTIVE = Group(rank, world, device, timeout, store, control)
    return _ACTIVE


def close() -> None:
    global _ACTIVE
    if _ACTIVE is None:
        return
    _ACTIVE = None
    try:
        dist.destroy_process_group()
    except Exception:  # a set whose peers are gone: nothing left to tear down cleanly
        pass


def active(op: str = "", node: str = "", group_size: int | None = None) -> Group:
    """The set this process belongs to, for a collective node. Outside a set (or in one of another size than the
    node's `group_size`) the node is refused, naming it: an all-reduce run alone would return a partial sum."""
    if _ACTIVE is None or (group_size is not None and _ACTIVE.world != group_size):
        where = f"{op} node {node!r}" if node else op
        have = "no tensor-parallel set" if _ACTIVE is None else f"a set of {_ACTIVE.world} ranks"
        size = f"of {group_size}" if group_size is not None else "(see genai_config.json's tensor_parallel)"
        raise TPError(f"{where}: the graph is one rank of a tensor-parallel set {size}, run in {have}: "
                      "run the model folder with --tp N (paged-run, paged-serve, paged-bench) or "
                      "pagedkit.runtime.distributed.TensorParallel")
    return _ACTIVE
