"""Where a batch-1 prefill's time to first token goes on the host: an Engine as paged-bench builds it, one prompt
of N tokens; TTFT timed over synchronized steps, then one prefill under torch.profiler (CPU + CUDA), its chrome
trace summarized: the GPU kernels' total, the host span of the step, the top-level torch ops (those no other op
contains) with their count per layer, their busy time and the Python gaps between them. The H200 trace at
e1b092d (991 tokens) showed 27 ms of host span against ~5 ms of kernels: host-bound.

    python benchmarks/probes/prefill_host.py MODEL_DIR [--tokens 991 4000] [--repeats 4] [--out FILE.json]
                                             [--trace DIR] [--device cuda|cpu]

Run on the device from the repository root (PYTHONPATH=$PWD). --device cpu is a smoke run (no kernels).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import importlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
versions = importlib.import_module("_provenance").versions
write_result = importlib.import_module("_provenance").write_result


def summarize(trace: dict, layers: int, top: int = 20) -> dict:
    """A chrome trace (torch.profiler's export) -> the host facts: top-level cpu_op events (not inside another),
    their count, busy time and the gaps between them; the CUDA kernels' total."""
    ops = sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                 key=lambda e: (e["ts"], -e["dur"]))
    tops, end = [], float("-inf")
    for e in ops:
        if e["ts"] >= end:
            tops.append(e)
            end = e["ts"] + e["dur"]
    kernels = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "kernel"]
    by_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in tops:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]
    busy = sum(e["dur"] for e in tops)
    span = (tops[-1]["ts"] + tops[-1]["dur"] - tops[0]["ts"]) if tops else 0.0
    return {
        "host_span_ms": round(span / 1e3, 3), "top_level_ops": len(tops),
        "top_level_ops_per_layer": round(len(tops) / max(layers, 1), 1),
        "op_busy_ms": round(busy / 1e3, 3), "gaps_ms": round((span - busy) / 1e3, 3),
        "kernels": len(kernels), "kernel_ms": round(sum(e["dur"] for e in kernels) / 1e3, 3),
        "top_ops": [{"name": n, "calls": c, "us": round(us, 1)}
                    for n, (c, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def _engine(model_dir: Path, device: str):
    from pagedkit.engine import Engine

    return Engine(model_dir, device, max_batch_size=32, max_num_tokens=16384, num_blocks=512,
                  enable_prefix_caching=False, cuda_graphs=None if device == "cuda" else False,
                  overlap=True if device == "cuda" else False)


def _ttft(engine, n: int, rng: random.Random, vocab: int, sync) -> float:
    """One request of n random tokens: ms from add_request to the step that returns its first token."""
    from pagedkit.engine import SamplingParams

    prompt = [rng.randrange(10, vocab) for _ in range(n)]
    sync()
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while True:
        outs = engine.step()
        sync()
        if any(o.new_token_ids for o in outs):
            break
    t = (time.perf_counter() - t0) * 1e3
    engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    return t


def profile_row(model_dir: Path, n: int, repeats: int, device: str, trace_dir: Path | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    engine = _engine(model_dir, device)
    cfg = engine.model.config
    layers, vocab = cfg.num_layers, int(cfg.vocab_size or 1000)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rng = random.Random(0)
    _ttft(engine, n, rng, vocab, sync)  # warm-up: kernels compiled, backends probed
    times = [_ttft(engine, n, rng, vocab, sync) for _ in range(repeats)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        profiled = _ttft(engine, n, rng, vocab, sync)
    path = (trace_dir / f"prefill_{n}.json") if trace_dir else Path(tempfile.mkdtemp()) / "trace.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return {"tokens": n, "layers": layers, "ttft_ms": [round(t, 3) for t in times],
            "ttft_median_ms": round(statistics.median(times), 3), "profiled_ttft_ms": round(profiled, 3),
            "variants": sorted(set(engine.model.session.last_run_variants.values())),
            **summarize(json.loads(path.read_text()), layers), "trace": str(path) if trace_dir else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, nargs="+", default=[991, 4000])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--trace", type=Path, default=None, help="folder for the chrome traces (default: not kept)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    rows = []
    for n in args.tokens:
        row = profile_row(args.model_dir, n, args.repeats, args.device, args.trace)
        rows.append(row)
        print(f"== {n} tokens: TTFT {row['ttft_median_ms']:.2f} ms (profiled {row['profiled_ttft_ms']:.2f}); host "
              f"span {row['host_span_ms']:.2f} ms = ops {row['op_busy_ms']:.2f} + gaps {row['gaps_ms']:.2f}; "
              f"{row['top_level_ops']} top-level ops ({row['top_level_ops_per_layer']} a layer); "
              f"{row['kernels']} kernels {row['kernel_ms']:.2f} ms; {row['variants']}", flush=True)
        for o in row["top_ops"][:12]:
            print(f"   {o['us']:9.1f} us {o['calls']:5d} x  {o['name']}")
    out = {"command": "python benchmarks/probes/prefill_host.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
           "note": "batch-1 prefill through the Engine (paged-bench's settings); TTFT over synchronized steps; "
                   "one profiled prefill's chrome trace summarized (top-level cpu ops, gaps, kernels)",
           "rows": rows}
    if args.out:
        write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
