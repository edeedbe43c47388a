"""A follower rank (1 .. N-1): joins the set, then runs what rank 0's messages say until STOP (messages.py).

For each RUN it feeds its own session the step inputs the message carries and its own caches: the same
shapes as rank 0's (every rank holds the same number of KV heads), made when first named and made anew when
rank 0's cache tensor changes (a new manager); the block copies rank 0's manager made for the step are applied
first. It computes what rank 0 computes on its shard, taking part in every collective in the same order.

Errors: a follower that fails writes one line under `error/<rank>` in the set's store and exits with status 1;
rank 0 reports it (launch.py). When rank 0 is gone (its connections closed) the follower exits quietly: rank 0's
own end is what the user sees.
"""

from __future__ import annotations

import os
import sys

import torch


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _caches(cache: dict, specs: list, sess, device) -> dict[str, torch.Tensor]:
    """The follower's cache tensors of one step (made when new or when rank 0's tensor changed)."""
    out = {}
    for name, dtype, shape, token in specs:
        have = cache.get(name)
        if have is None or have[0] != token:
            arg = next((a for a in sess.get_inputs() if a.name == name), None)
            fixed = [(i, d) for i, d in enumerate(arg.shape) if isinstance(d, int)] if arg is not None else []
            if arg is None or any(i >= len(shape) or shape[i] != d for i, d in fixed):
                raise ValueError(f"cache {name!r}: rank 0's shape {shape} does not fit this rank's graph "
                                 f"({arg.shape if arg is not None else 'no such input'})")
            have = cache[name] = (token, torch.zeros(shape, dtype=getattr(torch, dtype), device=device))
        out[name] = have[1]
    return out


def serve(g) -> None:
    """The message loop of a follower in set `g` (group.Group)."""
    from ..session import InferenceSession, SessionOptions
    from . import messages as M
    from .folder import rank_model_path

    sessions, caches = {}, {}
    while True:
        kind, meta, tensors = M.receive(g.control)
        if kind == M.STOP:
            return
        sid = meta.get("sid")
        if kind == M.DROP:
            sessions.pop(sid, None)
            caches.pop(sid, None)
        elif kind == M.LOAD:
            status = "ok"
            try:
                opts = meta["options"]
                threads = opts.pop("threads", None)
                sessions[sid] = InferenceSession(str(rank_model_path(meta["folder"], g.rank, g.world)),
                                                 SessionOptions(intra_op_num_threads=threads) if threads else None,
                                                 **opts)
                caches[sid] = {}
            except Exception as exc:  # reported by rank 0 (launch.TensorParallel.session)
                status = _one_line(exc)
            g.store.set(f"status/{sid}/{g.rank}", status)
        elif kind == M.RUN:
            sess = sessions[sid]
            feeds = dict(zip(meta["feeds"], (t.to(g.device) for t in tensors)))
            mine = _caches(caches[sid], meta["caches"], sess, g.device)
            for names, src, dst in meta["copies"]:
                for n in names:
                    t = mine[n]
                    t[dst].copy_(t[src])
            feeds.update(mine)
            sess.run_torch(feeds, meta["outputs"], plan=meta["plan"], distinct_slots=meta["distinct"])


def main(rank: int, world: int, store_path: str, device: str, timeout: float, threads: int | None) -> None:
    """The entry point of a spawned follower (launch.TensorParallel)."""
    from . import group

    store = None
    try:
        if threads:
            torch.set_num_threads(threads)
        dev = torch.device(device)
        if dev.type == "cuda":
            dev = torch.device("cuda", rank)
            torch.cuda.set_device(dev)
        import torch.distributed as dist

        store = dist.FileStore(store_path, world)
        store.set(f"ready/{rank}", str(os.getpid()))
        g = group.init(rank, world, store_path, dev, timeout)
        serve(g)
    except Exception as exc:
        text = _one_line(exc)
        if "Connection closed by peer" in text or "Connection reset" in text:
            os._exit(1)  # rank 0 is gone: its end is the one the user sees
        try:
            if store is not None:
                store.set(f"error/{rank}", text)
        except Exception:
            print(f"pagedkit tensor-parallel rank {rank}: {text}", file=sys.stderr, flush=True)
        os._exit(1)
    group.close()
    os._exit(0)
