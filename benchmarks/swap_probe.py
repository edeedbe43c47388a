"""The swapped-operand decode kernel (decode.SWAP_DECODE, PAGEDKIT_SWAP_DECODE) against the general one on the H200:
per row (benchmarks/attention_gqa.py / attention.py rows, plus the engine's decode shape: 32 / 8 heads, head 64,
256-token blocks), the whole operator call as CUDA-graph replays under each arm (general / swapped x tiles x
splits); err: max |out - out(general)| / max |that|.
Run on the device: PYTHONPATH=$PWD python3 benchmarks/swap_probe.py [ROW ...] [--out FILE]."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
tuning = importlib.import_module("quant_tuning")
pa_cases = importlib.import_module("_attention_cases")
time_graph = importlib.import_module("_timing").time_graph

from pagedkit.kernels.triton import decode  # noqa: E402

# the engine's Llama-3.2-1B-shaped decode (paged_bench_llama1b): head 64, batch 8 / 32, context 4096
ENGINE_ROWS = {f"engine-fp16-b{b}-ctx4k-h64": pa_cases.Case(f"engine-fp16-b{b}-ctx4k-h64", (4096,) * b, 256,
                                                            head_size=64) for b in (1, 8, 32)}
ROWS = ("gqa-decode-int8-b64-ctx4k", "gqa-decode-int8-b16-ctx4k", "gqa-decode-bf16int8-b64-ctx4k",
        "gqa-decode-fp16-b64-ctx4k", "gqa-decode-fp16-b16-ctx4k", "int8-b64-ctx8k-bs256", "fp8-b64-ctx8k-bs256",
        "fp16-b16-ctx4k-bs256", "engine-fp16-b1-ctx4k-h64", "engine-fp16-b8-ctx4k-h64", "engine-fp16-b32-ctx4k-h64")
# (label, swapped, overrides)
ARMS = (("general", False, {}), ("swap", True, {}), ("swap-64x4", True, {"block_n": 64, "num_warps": 4}),
        ("swap-128x4", True, {"block_n": 128, "num_warps": 4}), ("swap-128x8", True, {"block_n": 128, "num_warps": 8}),
        ("swap-32x2", True, {"block_n": 32, "num_warps": 2}), ("swap-64x2", True, {"block_n": 64, "num_warps": 2}),
        ("swap-256x8", True, {"block_n": 256, "num_warps": 8}))


def make_call(name: str, dev: torch.device):
    if name in ENGINE_ROWS:
        case = ENGINE_ROWS[name]
        x, attrs, _ = pa_cases.build_inputs(case, dev)
        floor = pa_cases.floor_ms(pa_cases.traffic(case)["total"])
        from pagedkit.kernels.triton import paged
        return (lambda: paged.paged_attention(x, outputs=["output"], validate=False, **attrs)["output"]), floor
    return tuning.make_call(name, dev)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", default=list(ROWS))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "swap_probe.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    real = decode.paged_decode
    override: dict = {}

    def patched(q, **kw):
        return decode._paged_decode(q, **({"num_splits": None} | kw | override)) if override else real(q, **kw)

    decode.paged_decode = patched
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(dev),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "what": "the whole operator call, CUDA-graph replays, median of 3 x 20 (ms)", "rows": {}}
    for name in args.rows:
        call, floor = make_call(name, dev)
        arms, ref = [], None
        for label, pre, ov in ARMS:
            decode.SWAP_DECODE = pre
            override.clear()
            override.update(ov)
            try:
                out = call().float()
                ms = time_graph(call, 20, 3)
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                print(f"  {name} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            if ref is None:
                ref = out
            err = float((out - ref).abs().max() / ref.abs().max())
            arms.append({"arm": label, "swap": pre, **ov, "ms": ms, "fraction_of_floor": floor / ms, "err": err})
        decode.SWAP_DECODE = False
        override.clear()
        result["rows"][name] = {"floor_ms": floor, "arms": arms}
        print(f"{name}: floor {floor:.4f} | " + " ".join(f"{a['arm']} {a['ms']:.4f} ({a['fraction_of_floor']:.2f}"
                                                         f"{', err %.1e' % a['err'] if a['err'] > 1e-3 else ''})"
                                                         for a in arms), flush=True)
        torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
