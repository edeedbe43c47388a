"""The step messages rank 0 broadcasts over the control group (group.py): what every follower does next.

A message is two gloo broadcasts from rank 0: a header int64 [kind, json bytes, payload bytes], then one uint8
payload: a JSON description followed by the raw bytes of its tensors (each described in the JSON by dtype and
shape, in order). Kinds: LOAD a model folder's rank graphs (session id, folder, session options), RUN one step of
a session (its small step inputs travel in the message: token ids, block tables, lengths, slot mapping, ...; the
caches stay where they are, one set per rank; the KV manager's block copies of the step ride along), DROP a
session, STOP the follower. Nothing here is pickled: JSON and raw tensor bytes only.
"""

from __future__ import annotations

import datetime
import json

import torch
import torch.distributed as dist

STOP, LOAD, RUN, DROP = 0, 1, 2, 3


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _broadcast(t: torch.Tensor, control, timeout: float | None) -> None:
    work = dist.broadcast(t, 0, group=control, async_op=True)
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout))


def send(control, kind: int, meta: dict, tensors: list[torch.Tensor] = (), timeout: float | None = None) -> None:
    """Broadcast one message (rank 0), within `timeout` seconds (a follower that stopped answering)."""
    meta = dict(meta, tensors=[[dtype_name(t.dtype), list(t.shape)] for t in tensors])
    body = json.dumps(meta).encode("utf-8")
    parts = [torch.frombuffer(bytearray(body), dtype=torch.uint8)] + [_bytes(t) for t in tensors]
    payload = torch.cat(parts)
    _broadcast(torch.tensor([kind, len(body), payload.numel()], dtype=torch.int64), control, timeout)
    _broadcast(payload, control, timeout)


def receive(control) -> tuple[int, dict, list[torch.Tensor]]:
    """The next message (a follower): (kind, JSON description, tensors on the CPU)."""
    head = torch.empty(3, dtype=torch.int64)
    dist.broadcast(head, 0, group=control)
    kind, nbody, n = (int(v) for v in head.tolist())
    payload = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(payload, 0, group=control)
    meta = json.loads(bytes(payload[:nbody].numpy()).decode("utf-8"))
    tensors, at = [], nbody
    for name, shape in meta.pop("tensors"):
        dtype = getattr(torch, name)
        size = torch.empty((), dtype=dtype).element_size()
        count = 1
        for d in shape:
            count *= d
        raw = payload[at:at + count * size].clone()  # its own storage: aligned for the dtype
        tensors.append(raw.view(dtype).reshape(shape) if count else torch.empty(shape, dtype=dtype))
        at += count * size
    return kind, meta, tensors
