"""Time to first token with and without the prefill graphs (engine/prefill_graphs.py), in one engine and process,
alternating: batch-1 prompts of N random tokens through the Engine as paged-bench builds it
(probes/prefill_host.py's engine and timing). 'on': first prompts replay a CUDA graph per token bucket (each
bucket captured in the warm-up); 'off': engine.model.prefill_graphs = None (the eager prefill, as before).
Each row records the prefill floor (apps/bench/floor.py: FLOPs / 790 TFLOP/s + weights / 4.4 TB/s) and the
fraction of it each arm reaches; the peer's TTFT is not measured here (paged-bench's ort arm does that).

    python benchmarks/probes/prefill_graphs_ab.py MODEL_DIR [--tokens 991 4063] [--pairs 5] [--out FILE.json]

Run on the device from the repository root (PYTHONPATH=$PWD). --device cpu is a smoke run of the script.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
versions = importlib.import_module("_provenance").versions
write_result = importlib.import_module("_provenance").write_result
ph = importlib.import_module("prefill_host")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, nargs="+", default=[991, 4063])
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    from pagedkit.apps.bench import floor
    from pagedkit.runtime.generate import read_config

    engine = ph._engine(args.model_dir, args.device)
    pm = engine.model
    graphs = pm.prefill_graphs
    if graphs is None:
        print(f"no prefill graphs: {pm.prefill_graphs_off_reason}", file=sys.stderr)
        return 1
    cfg = read_config(args.model_dir)
    path = args.model_dir / cfg.filename
    weights, products = floor.weight_bytes(path), floor.product_weights(path)
    layers = floor.cache_layers(pm.groups.values())
    vocab = int(cfg.vocab_size or 1000)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rng = random.Random(0)
    rows = []
    for n in args.tokens:
        res: dict[str, list[float]] = {"on": [], "off": []}
        for k in range(args.pairs + 1):  # the first pair is the warm-up (the 'on' arm captures its graph there)
            for arm in ("on", "off"):
                pm.prefill_graphs = graphs if arm == "on" else None
                t = ph._ttft(engine, n, rng, vocab, sync)
                if k:
                    res[arm].append(t)
        pm.prefill_graphs = graphs
        fl = floor.prefill_floor(weights, products, layers, cfg.num_heads, cfg.head_size, 1, n)
        med = {a: statistics.median(v) for a, v in res.items()}
        row = {"tokens": n, **{f"ttft_ms_{a}": [round(t, 3) for t in v] for a, v in res.items()},
               **{f"median_{a}": round(m, 3) for a, m in med.items()},
               "prefill_floor_ms": round(fl["ms"], 4),
               **{f"fraction_of_floor_{a}": round(fl["ms"] / m, 3) for a, m in med.items()}}
        rows.append(row)
        print(f"== {n} tokens: TTFT on {med['on']:.2f} ms, off {med['off']:.2f} ms (median of {args.pairs}); "
              f"prefill floor {fl['ms']:.3f} ms", flush=True)
    st = graphs.stats
    out = {"command": "python benchmarks/probes/prefill_graphs_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
           "note": "time to first token with the prefill graphs ('on') and without ('off'), the same engine, "
                   "alternating, after one warm-up pair per prompt length; prefill floor = FLOPs / 790 TFLOP/s + "
                   "weight bytes / 4.4 TB/s",
           "prefill_graphs": {"captured": st.captured, "replays": st.replays, "keys": st.keys,
                              "capture_error": st.capture_error},
           "rows": rows}
    if args.out:
        write_result(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
