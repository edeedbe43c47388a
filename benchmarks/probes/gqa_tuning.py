"""Tile sweep of triton_gqa's attention (the BNSH accessor of the decode kernel) on the H200: the whole
GroupQueryAttention call as CUDA-graph replays over block_n x num_warps x num_splits per row of
benchmarks/attention_gqa.py (results: benchmarks/results/gqa_tuning.json).
Run on the device: PYTHONPATH=$PWD python3 benchmarks/probes/gqa_tuning.py [ROW ...] [--out DIR]."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
bench = importlib.import_module("attention_gqa")
time_graph = importlib.import_module("_timing").time_graph

from pagedkit.kernels.triton import decode, gqa  # noqa: E402

ROWS = ("gqa-decode-fp16-b16-ctx4k", "gqa-decode-bf16-b16-ctx4k", "gqa-decode-fp16-b64-ctx4k",
        "gqa-decode-fp16-b16-ctx1k", "gqa-decode-int8-b16-ctx4k", "gqa-decode-int8-b64-ctx4k")
CONFIGS = [(bn, nw, s) for bn in (32, 64, 128) for nw in (4, 8) for s in (None, 1, 2, 4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", default=list(ROWS))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    args = ap.parse_args()
    dev = torch.device("cuda")
    real = decode.paged_decode
    override: dict = {}

    def patched(q, **kw):
        if override:
            kw = dict(kw, **{k: v for k, v in override.items() if k != "num_splits"})
            return decode._paged_decode(q, **(kw | {"num_splits": override.get("num_splits")}))
        return real(q, **kw)

    decode.paged_decode = patched
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(dev),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "what": "triton_gqa's whole call (write + attention + reduce), CUDA-graph replays, median of 3 x 20; "
                      "splits None = the default heuristic", "rows": {}}
    for name in args.rows:
        case = bench.CASES[name]
        x, attrs = bench.build_inputs(case, dev)
        floor = bench.floor_ms(case, bench.BANDWIDTH_TB_S, bench.PEAK_TFLOP_S)

        def call():
            return gqa.group_query_attention(x, outputs=["output"], validate=False, **attrs)["output"]

        override.clear()
        ref = call().float()
        default = time_graph(call, 20, 3)
        sweep = []
        for bn, nw, s in CONFIGS:
            override.clear()
            override.update(block_n=bn, num_warps=nw, num_splits=s)
            try:
                err = float((call().float() - ref).abs().max() / ref.abs().max())
                ms = time_graph(call, 20, 3)
            except Exception as exc:  # noqa: BLE001 - a config the kernel refuses
                print(f"  {name} {bn}/{nw}/{s}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            sweep.append({"block_n": bn, "num_warps": nw, "splits": s, "ms": ms, "err": err})
        override.clear()
        sweep.sort(key=lambda r: r["ms"])
        result["rows"][name] = {"floor": floor, "default_ms": default, "sweep": sweep}
        print(f"{name}: floor {floor} default {default:.4f} ms; best " +
              "; ".join(f"{r['block_n']}/{r['num_warps']}/{r['splits']} {r['ms']:.4f}" for r in sweep[:5]), flush=True)
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gqa_tuning.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
