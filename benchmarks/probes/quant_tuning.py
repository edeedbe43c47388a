"""Sweep of the quantized-cache decode on the H200 (results: benchmarks/results/quant_tuning.json): the whole
GroupQueryAttention / PagedAttention call as CUDA-graph replays, per row of benchmarks/attention_gqa.py (plus
bfloat16 twins) and benchmarks/attention.py, over the cache-code conversion (decode.QUANT_ASM: packed inline asm
in the load's layout, or the plain conversions), the int8 tensor-core path (decode.INT8_MMA), software-pipeline
stages and block_n x num_warps.
Run on the device: PYTHONPATH=$PWD python3 benchmarks/probes/quant_tuning.py [ROW ...] [--out DIR] [--quick]."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
gqa_bench = importlib.import_module("attention_gqa")
pa_cases = importlib.import_module("_attention_cases")
time_graph = importlib.import_module("_timing").time_graph

from pagedkit.kernels.triton import decode, gqa, paged  # noqa: E402

GQA_ROWS = ("gqa-decode-int8-b64-ctx4k", "gqa-decode-int8-b16-ctx4k", "gqa-decode-bf16int8-b64-ctx4k",
            "gqa-decode-int4-b16-ctx4k")
PA_ROWS = ("int8-b64-ctx8k-bs256", "fp8-b64-ctx8k-bs256", "int8-b64-ctx8k-bs16", "int8-b16-ctx4k-bs16",
           "int4-channel-b64-ctx8k-bs16")
TILES = ((128, 8), (256, 8), (64, 4), (64, 8))
PICK = ("gqa-decode-int8-b64-ctx4k", "fp8-b64-ctx8k-bs256", "gqa-decode-int4-b16-ctx4k")


def gqa_case(name: str):
    for cases in (gqa_bench.CASES, gqa_bench.DRY_CASES):
        if name in cases:
            return cases[name]
    if name == "gqa-decode-bf16int8-b64-ctx4k":  # the int8 row's bfloat16 twin
        return dataclasses.replace(gqa_bench.CASES["gqa-decode-int8-b64-ctx4k"], name=name, dtype="bf16")
    raise KeyError(name)


def make_call(name: str, dev: torch.device):
    """-> (call, floor_ms) for one row: the whole operator call with validation off."""
    if name.startswith(("gqa-", "dry-decode")):
        case = gqa_case(name)
        x, attrs = gqa_bench.build_inputs(case, dev)
        floor = gqa_bench.floor_ms(case, gqa_bench.BANDWIDTH_TB_S, gqa_bench.PEAK_TFLOP_S)["floor_ms"]
        return (lambda: gqa.group_query_attention(x, outputs=["output"], validate=False, **attrs)["output"]), floor
    case = pa_cases.CASES.get(name) or pa_cases.DRY_CASES[name]
    x, attrs, outputs = pa_cases.build_inputs(case, dev)
    floor = pa_cases.floor_ms(pa_cases.traffic(case)["total"])
    return (lambda: paged.paged_attention(x, outputs=["output"], validate=False, **attrs)["output"]), floor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="*", default=list(GQA_ROWS + PA_ROWS))
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    ap.add_argument("--quick", action="store_true", help="the conversion / MMA / stages arms only, default tiles")
    ap.add_argument("--pick", nargs="+", default=list(PICK), help="rows whose best arms (per cache format) --env-out writes")
    ap.add_argument("--env-out", type=Path, help="write the picked arm as `export` lines (a shell file)")
    ap.add_argument("--dry-run", action="store_true", help="CPU (TRITON_INTERPRET=1), tiny rows, one call per arm")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.dry_run else "cuda")
    timer = (lambda fn, *_: __import__("_timing").time_wall(fn, 1, 1, dev)[0]) if args.dry_run else time_graph
    real = decode.paged_decode
    override: dict = {}

    def patched(q, **kw):
        return decode._paged_decode(q, **({"num_splits": None} | kw | override)) if override else real(q, **kw)

    decode.paged_decode = patched
    asm0, mma0 = decode.QUANT_ASM, decode.INT8_MMA
    picked: dict = {}
    result = {"command": "python " + " ".join(sys.argv), "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(dev),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "what": "the whole operator call (write + attention + reduce), CUDA-graph replays, median of 3 x 20 "
                      "(ms); err: max |out - out(plain conversion, defaults)| / max |that|", "rows": {}}
    for name in args.rows:
        try:
            call, floor = make_call(name, dev)
        except KeyError:
            print(f"{name}: no such row", flush=True)
            continue
        arms: list[dict] = []

        def arm(label: str, asm: str, mma: str, **ov):
            decode.QUANT_ASM, decode.INT8_MMA = decode.parse_quant_asm(asm or "0"), mma
            override.clear()
            override.update(ov)
            try:
                out = call().float()
                ms = timer(call, 20, 3)
            except Exception as exc:  # noqa: BLE001 - a config the kernel or compiler refuses
                print(f"  {name} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                return None
            arms.append({"arm": label, "asm": asm, "int8_mma": mma, **ov, "ms": ms,
                         "fraction_of_floor": floor / ms})
            return out

        ref = arm("plain", "", "")
        for asm, mma in (("kv", ""), ("v", ""), ("v", "k"), ("", "kv")):
            if "k" not in mma or "int8" in name:
                arm(f"asm_{asm or 0}-mma_{mma or 0}", asm, mma)
        for st in () if args.quick else (2,):
            arm(f"asm_v-stages{st}", "v", "", num_stages=st)
        if not args.quick and "int8" in name:  # fewer warps, more splits; deeper pipelines
            for bn, nw in ((64, 1), (64, 2), (32, 1), (32, 2), (128, 2), (64, 4)):
                for sp in (2, 4, 8) if nw < 4 else (2,):
                    arm(f"asm_v-mma_k-{bn}x{nw}-splits{sp}", "v", "k", block_n=bn, num_warps=nw, num_splits=sp)
            for bn, nw in ((64, 4), (128, 4)):
                arm(f"asm_v-mma_k-{bn}x{nw}-stages4", "v", "k", block_n=bn, num_warps=nw, num_stages=4)
        if not args.quick:
            for asm, mma in (("v", ""), ("v", "k")):
                if "k" in mma and "int8" not in name:
                    continue
                for bn, nw in TILES:
                    arm(f"asm_{asm}-mma_{mma or 0}-{bn}x{nw}", asm, mma, block_n=bn, num_warps=nw)
        decode.QUANT_ASM, decode.INT8_MMA = asm0, mma0
        override.clear()
        if ref is not None:  # parity of every arm against the plain conversion at the defaults
            for a in arms:
                decode.QUANT_ASM, decode.INT8_MMA = decode.parse_quant_asm(a["asm"] or "0"), a["int8_mma"]
                override.update({k: a[k] for k in ("block_n", "num_warps", "num_stages", "num_splits") if k in a})
                a["err"] = float((call().float() - ref).abs().max() / ref.abs().max())
                override.clear()
        decode.QUANT_ASM, decode.INT8_MMA = asm0, mma0
        best = sorted(arms, key=lambda r: r["ms"])
        result["rows"][name] = {"floor_ms": floor, "arms": arms}
        print(f"{name}: floor {floor:.4f} | " + " ".join(f"{a['arm']} {a['ms']:.4f}" for a in arms[:6]) +
              " | best " + "; ".join(f"{r['arm']} {r['ms']:.4f} ({r['fraction_of_floor']:.2f})" for r in best[:4]),
              flush=True)
        torch.cuda.empty_cache()
        fmt = next((f for f in ("int8", "fp8", "int4") if f in name), None)
        if name in args.pick and fmt:  # the best arm at the default tiles and stages per cache format
            top = min((a for a in arms if "block_n" not in a and "num_stages" not in a), key=lambda a: a["ms"])
            picked[fmt] = {"row": name, "arm": top["arm"], "ms": top["ms"], "asm": top["asm"] or "0",
                           "int8_mma": top["int8_mma"]}
            if fmt == "int8":  # tiles / splits / stages of the wide quantized grid, when >= 3% faster
                best = min(arms, key=lambda a: a["ms"])
                if "block_n" in best and best["ms"] < 0.97 * top["ms"]:
                    programs = gqa_case(name).batch * gqa_case(name).kv_heads if name.startswith("gqa-") else None
                    picked["wide"] = {"arm": best["arm"], "ms": best["ms"], "asm": best["asm"] or "0",
                                      "int8_mma": best["int8_mma"],
                                      "tile": f"{best['block_n']}x{best['num_warps']}",
                                      "stages": best.get("num_stages"),
                                      "waves": (best["num_splits"] * programs / (torch.cuda.get_device_properties(
                                          dev).multi_processor_count if dev.type == "cuda" else 132)) if "num_splits" in best and programs else None}
    result["picked"] = picked
    if args.env_out and picked:
        wide = picked.get("wide")
        fmts = {f: p for f, p in picked.items() if f != "wide"}
        if wide:
            fmts["int8"] = dict(fmts.get("int8", {}), asm=wide["asm"], int8_mma=wide["int8_mma"])
        spec = ",".join(f"{f}:{p['asm']}" for f, p in fmts.items())
        lines = [f"export PAGEDKIT_QUANT_ASM={spec}",
                 f"export PAGEDKIT_INT8_MMA={fmts.get('int8', {}).get('int8_mma') or '0'}"]
        if wide:
            lines.append(f"export PAGEDKIT_QUANT_TILE={wide['tile']}")
            if wide["stages"]:
                lines.append(f"export PAGEDKIT_QUANT_STAGES={wide['stages']}")
            if wide["waves"]:
                lines.append(f"export PAGEDKIT_QUANT_WAVES={wide['waves']:.3f}")
        args.env_out.write_text("\n".join(lines) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_tuning.json").write_text(json.dumps(result, indent=1) + "\n")

    return 0


if __name__ == "__main__":
    raise SystemExit(main())
