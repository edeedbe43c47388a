"""GPU profile of one engine decode step of an exported paged model: where the step's time goes.

    python benchmarks/step_profile.py MODEL_DIR [--rows 1x1024 8x4096 32x4096] [--out FILE.json] [--top 25]

For each row BATCHxCONTEXT: B requests of CONTEXT - 16 random prompt tokens are prefilled by an Engine
(CUDA graphs on, overlap off), decoded a few steps (the decode graph is captured), then
- replay_ms: back-to-back replays of the captured decode graph (CUDA events, 50 replays);
- step_ms: engine.step() with a synchronize each (median of 20; host planning included);
- kernels: one eager padded decode step (the same plan the graph replays) under torch.profiler, the CUDA
  kernels grouped by name (calls, total us), largest first, and their sum.
The eager step's plan is aborted afterwards (its cache writes land in slots the next real step rewrites).
Prints a table per row; --out writes the JSON. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _row(text: str) -> tuple[int, int]:
    b, c = text.lower().split("x", 1)
    return int(b), int(c)


def profile_row(model_dir: Path, batch: int, context: int, top: int, seed: int = 0, device: str = "cuda") -> dict:
    import torch

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    from pagedkit.runtime.engine import Engine, SamplingParams

    rng = random.Random(seed)
    prompt_len = context - 16
    engine = Engine(model_dir, device, max_batch_size=batch, max_num_tokens=2048,
                    num_blocks=batch * (-(-context // 16) + 1), enable_prefix_caching=False, overlap=False,
                    cuda_graphs=None if cuda else "padded")
    vocab = engine.vocab_size or 1000
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_len)], params)
    while not all(r.decoding for r in engine.running) or len(engine.running) < batch:
        engine.step()
    for _ in range(4):  # capture + a few replays
        engine.step()
    sync()
    graphs = engine.model.graphs
    key = graphs.key([(r.request_id, 1) for r in engine.running])
    replay_ms = None
    if cuda:
        g = graphs.graphs[key].graph
        for _ in range(5):
            g.replay()
        sync()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(50):
            g.replay()
        e1.record()
        sync()
        replay_ms = e0.elapsed_time(e1) / 50
    steps = []
    for _ in range(20):
        s = time.perf_counter()
        engine.step()
        sync()
        steps.append((time.perf_counter() - s) * 1e3)
    # one eager padded step under the profiler
    batch_ids = [(r.request_id, [r.tokens[-1]]) for r in engine.running]
    plan = graphs.plan(batch_ids)
    feeds = engine.model.feeds(plan, [t for _, (t,) in batch_ids] + [0] * (key[0] - len(batch_ids)))
    engine.model.forward(feeds, plan.hint)
    sync()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        engine.model.forward(feeds, plan.hint)
        sync()
    graphs.abort(plan)
    engine.kv.abort(plan)
    kernels: dict[str, list[float]] = {}
    for row in prof.key_averages():
        us = getattr(row, "self_device_time_total", None)
        if us is None:
            us = getattr(row, "self_cuda_time_total", 0.0)
        if not cuda:
            us = row.self_cpu_time_total
        if us > 0:
            kernels[row.key] = [row.count, us]
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    total_us = sum(v[1] for v in kernels.values())
    for r in list(engine.running):
        engine.abort(r.request_id)
    while engine.has_unfinished():
        engine.step()
    del engine, graphs
    if cuda:
        torch.cuda.empty_cache()
    return {"batch": batch, "context": context, "graph_key": list(key), "replay_ms": replay_ms,
            "step_ms": statistics.median(steps), "kernel_us": total_us,
            "kernel_launches": sum(v[0] for v in kernels.values()),
            "kernels": [{"name": n[:160], "calls": v[0], "us": round(v[1], 2)} for n, v in ranked[:top]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--rows", nargs="+", type=_row, default=[(1, 1024), (8, 4096), (32, 4096)])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run (no replay timing)")
    args = ap.parse_args(argv)
    out = []
    for b, c in args.rows:
        rec = profile_row(args.model_dir, b, c, args.top, device=args.device)
        out.append(rec)
        replay = "-" if rec["replay_ms"] is None else f"{rec['replay_ms']:.3f}"
        print(f"== batch {b} context {c}: replay {replay} ms, synced step {rec['step_ms']:.3f} ms, "
              f"{rec['kernel_launches']} kernels {rec['kernel_us'] / 1e3:.3f} ms")
        for k in rec["kernels"]:
            print(f"  {k['us']:9.1f} us {k['calls']:4d}x  {k['name'][:110]}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
