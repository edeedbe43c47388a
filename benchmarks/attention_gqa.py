"""One com.microsoft GroupQueryAttention call on the H200: pagedkit's Triton variant (`triton_gqa`) against
onnxruntime-gpu's own GQA kernel on the same inputs, in the same run, against the bandwidth / compute floor.
Writes <out>/attention_gqa.json; docs/benchmarks.md ("GroupQueryAttention: attention_gqa.py") says more.

    PYTHONPATH=/tmp/ortgpu:$PWD python3 benchmarks/attention_gqa.py --out benchmarks/results   # every row
    python3 benchmarks/attention_gqa.py --quick                  # a few rows (--list: the rows)
    TRITON_INTERPRET=1 python3 benchmarks/attention_gqa.py --dry-run --out /tmp/gqa   # CPU plumbing, tiny shapes

Inputs (seeded): query / key / value [B, S, *] in T, past_key / past_value [B, Hkv, C, Dc] of random values (or
int8 / packed int4 codes), C = context + headroom; seqlens_k = context - 1 (device), total_sequence_length =
context (host); do_rotary=1, cos / sin_cache [C, D/2]. Past and present share one buffer (C >= total), written
in place, as onnxruntime-genai runs GQA; a prefill row is a first prompt in that buffer (total = S = C).
Arms, each on its own copy of the caches: triton_gqa (validate=False, one call captured as a CUDA graph and
replayed, _timing.time_graph; eager_ms beside it), ort (one-node model, CUDAExecutionProvider with
enable_cuda_graph=1, IOBinding, present_* bound to the past buffers; ort_no_graph when the graph arm fails).
A refusal or failure is {"skipped": reason}; the exit code is 0 whatever an arm does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import gc
import importlib
import json
import os
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(REPO)]
versions = importlib.import_module("_provenance").versions  # benchmarks/_provenance.py
_timing = importlib.import_module("_timing")  # benchmarks/_timing.py
time_graph, Skip, one_line, sync, time_wall = (_timing.time_graph, _timing.Skip, _timing.one_line, _timing.sync,
                                               _timing.time_wall)
_ort_peer = importlib.import_module("_ort_peer")  # benchmarks/_ort_peer.py

BANDWIDTH_TB_S = 4.4  # H200 HBM3e peak
PEAK_TFLOP_S = 790.0  # H200 dense fp16 / bf16 tensor-core peak
PARITY_WARN = 2e-2
ENTRY = "pagedkit.kernels.triton.gqa:group_query_attention"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
CACHE_BYTES = {"float": 2.0, "int8": 1.0, "int4": 0.5}
QUANT_STEP = {"int8": 3.0 / 127, "int4": 3.0 / 7}
OUTPUTS = ["output", "present_key", "present_value"]


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int  # keys each sequence attends to after the step (seqlens_k + 1)
    seq: int = 1  # new tokens per sequence (S); > 1 with seq == context: a first prompt
    num_heads: int = 32
    kv_heads: int = 8
    head_size: int = 128
    dtype: str = "fp16"  # T: fp16 | bf16
    cache: str = "float"  # float (in T) | int8 | int4
    quant: str = "NONE"  # k / v_quant_type of a quantized cache
    headroom: int = 256  # capacity = context + headroom (prefill: 0)

    @property
    def prefill(self) -> bool:
        return self.seq > 1

    @property
    def capacity(self) -> int:
        return self.context + self.headroom


def _dec(b, ctx, dtype="fp16", cache="float", quant="NONE") -> Case:
    tag = dtype if cache == "float" else cache
    return Case(f"gqa-decode-{tag}-b{b}-ctx{ctx // 1024}k", b, ctx, dtype=dtype, cache=cache, quant=quant)


CASES = {c.name: c for c in (
    *(_dec(b, ctx) for b in (1, 16, 64) for ctx in (1024, 4096)),
    _dec(16, 4096, "bf16"), _dec(64, 4096, "bf16"),
    *(Case(f"gqa-prefill-{t}-b4-ctx4k", 4, 4096, seq=4096, dtype=t, headroom=0) for t in ("fp16", "bf16")),
    _dec(16, 4096, cache="int8", quant="PER_TENSOR"), _dec(64, 4096, cache="int8", quant="PER_TENSOR"),
    _dec(16, 4096, cache="int4", quant="PER_CHANNEL"),
)}
QUICK = ("gqa-decode-fp16-b16-ctx4k", "gqa-decode-fp16-b64-ctx4k", "gqa-prefill-fp16-b4-ctx4k",
         "gqa-decode-int8-b16-ctx4k")
_TINY = {"num_heads": 4, "kv_heads": 2, "head_size": 32, "headroom": 16}
DRY_CASES = {c.name: c for c in (  # --dry-run: CPU, tiny shapes
    Case("dry-decode-fp16", 2, 64, **_TINY),
    Case("dry-prefill-fp16", 2, 32, seq=32, **(_TINY | {"headroom": 0})),
    Case("dry-decode-int8", 2, 64, cache="int8", quant="PER_TENSOR", **_TINY),
    Case("dry-decode-int4", 2, 64, cache="int4", quant="PER_CHANNEL", **_TINY),
    Case("dry-decode-bf16", 2, 64, dtype="bf16", **_TINY),
)}


# ---- bytes, FLOPs, the floor -------------------------------------------------------------------------------------
def traffic(c: Case) -> dict:
    """Bytes one call must move: each sequence's K and V cache over its `context` keys (int8: 1 byte, int4: 0.5 per
    element), plus the step's Q, new K / V and output (2 bytes each)."""
    per_token = c.kv_heads * 2 * c.head_size * CACHE_BYTES[c.cache]
    tokens = c.batch * c.seq
    io = tokens * (2 * c.num_heads * c.head_size + 2 * c.kv_heads * c.head_size) * 2
    kv = c.batch * c.context * per_token
    return {"kv_bytes_per_token": per_token, "kv": kv, "q_kv_out": io, "total": kv + io}


def flops(c: Case) -> float:
    """Causal attention FLOPs (QK^T and PV): 4 * B * H * D per admitted (query, key) pair."""
    past = c.context - c.seq
    pairs = c.seq * past + c.seq * (c.seq + 1) // 2
    return 4.0 * c.batch * c.num_heads * c.head_size * pairs


def floor_ms(c: Case, bandwidth: float, tflops: float) -> dict:
    t = traffic(c)
    out = {"bytes": t, "bandwidth_floor_ms": t["total"] / (bandwidth * 1e12) * 1e3}
    out["floor_ms"] = out["bandwidth_floor_ms"]
    if c.prefill:
        out["flops"] = flops(c)
        out["compute_floor_ms"] = out["flops"] / (tflops * 1e12) * 1e3
        out["floor_ms"] = max(out["floor_ms"], out["compute_floor_ms"])
    return out


# ---- inputs and the one-node model -------------------------------------------------------------------------------
def build_inputs(c: Case, device: torch.device, seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator(device=device).manual_seed(seed)
    b, s, h, hkv, d, cap = c.batch, c.seq, c.num_heads, c.kv_heads, c.head_size, c.capacity
    t = DTYPES[c.dtype]

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.float32).to(t)

    def cache():
        shape = (b, hkv, cap, d // 2 if c.cache == "int4" else d)
        if c.cache == "float":
            return randn(*shape)
        lo, hi, dty = (-127, 128, torch.int8) if c.cache == "int8" else (0, 256, torch.uint8)
        return torch.randint(lo, hi, shape, generator=g, device=device, dtype=torch.int32).to(dty)

    angle = torch.rand((cap, d // 2), generator=g, device=device) * 6.28
    x = {"query": randn(b, s, h * d), "key": randn(b, s, hkv * d), "value": randn(b, s, hkv * d),
         "past_key": cache(), "past_value": cache(),
         "seqlens_k": torch.full((b,), c.context - 1, dtype=torch.int32, device=device),
         "total_sequence_length": torch.tensor([c.context], dtype=torch.int32),  # host memory
         "cos_cache": angle.cos().to(t), "sin_cache": angle.sin().to(t)}
    attrs = {"num_heads": h, "kv_num_heads": hkv, "do_rotary": 1}
    if c.cache != "float":
        attrs.update(k_quant_type=c.quant, v_quant_type=c.quant, kv_cache_bit_width=8 if c.cache == "int8" else 4)
        for side in ("k_scale", "v_scale"):
            shape = (1,) if c.quant == "PER_TENSOR" else (1, hkv, 1, d)
            x[side] = QUANT_STEP[c.cache] * (0.5 + torch.rand(shape, generator=g, device=device))
    return x, attrs


def arm_copy(base: dict) -> dict:
    """One arm's inputs: its own copies of the caches (written in place), the rest shared (read only)."""
    return {k: (v.clone() if k in ("past_key", "past_value") else v) for k, v in base.items()}


def onnx_model(x: dict, attrs: dict):
    """A one-node GroupQueryAttention model (pagedkit's node builder, validated); names are the contract names."""
    from onnx import helper

    from pagedkit.validators import make_gqa_node
    from pagedkit.validators.nodeview import onnx_dtype_of

    info = {n: (onnx_dtype_of(t), tuple(t.shape)) for n, t in x.items()}
    info["output"] = info["query"]  # [B, S, H * D]
    info["present_key"], info["present_value"] = info["past_key"], info["past_value"]  # capacity >= total
    node = make_gqa_node({n: n for n in x}, {n: n for n in OUTPUTS}, name="gqa", value_info=info, **attrs)
    graph = helper.make_graph([node], "gqa_bench", [helper.make_tensor_value_info(n, *info[n]) for n in node.input if n],
                              [helper.make_tensor_value_info(n, *info[n]) for n in node.output if n])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                  helper.make_opsetid("com.microsoft", 1)])


# ---- timing and the arms -----------------------------------------------------------------------------------------
def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def triton_arm(base: dict, attrs: dict, args, device) -> tuple[dict, torch.Tensor]:
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Skip("on the CPU the Triton arm needs TRITON_INTERPRET=1")
    mod, _, fn_name = ENTRY.partition(":")
    try:
        fn = getattr(importlib.import_module(mod), fn_name)
    except (ImportError, AttributeError) as exc:
        raise Skip(f"{ENTRY} does not import: {one_line(exc)}") from None
    x = arm_copy(base)

    def call():
        return fn(x, outputs=OUTPUTS, validate=False, **attrs)

    try:
        for _ in range(args.warmup):
            call()
    except (NotImplementedError, ImportError) as exc:  # a refusal
        raise Skip(one_line(exc)) from None
    sync(device)
    eager = time_wall(call, args.replays, args.batches, device)
    res = {"eager_ms": statistics.median(eager), "eager_samples_ms": [round(v, 5) for v in eager]}
    if device.type != "cuda":
        res.update(ms=res["eager_ms"], timing="eager (CPU, Triton interpreter)")
    else:
        try:
            res["ms"] = time_graph(call, reps=args.replays, batches=args.batches, warmup=args.warmup)
            res["timing"] = (f"CUDA graph replay (_timing.time_graph), CUDA events around {args.replays} replays, "
                             f"median of {args.batches}")
        except Exception as exc:  # noqa: BLE001 - not capturable: the eager time, flagged
            tqdm_write(f"[{args.row}] triton_gqa: CUDA graph capture failed ({one_line(exc)}); eager time")
            res.update(ms=res["eager_ms"], timing="eager (CUDA graph capture failed), wall clock",
                       graph_error=one_line(exc))
    got = call()
    res["present_in_place"] = got["present_key"].data_ptr() == x["past_key"].data_ptr()  # the shared buffer
    out = got["output"].clone()
    sync(device)
    return res, out


def ort_arm(base: dict, attrs: dict, args, device, graph: bool) -> tuple[dict, torch.Tensor]:
    x = arm_copy(base)
    out = torch.full_like(x["query"], float("nan"))  # [B, S, H * D]
    try:  # total_sequence_length stays in host memory; the presents are the past buffers
        call = _ort_peer.bound_call(onnx_model(x, attrs), x, {"output": out, "present_key": x["past_key"],
                                                              "present_value": x["past_value"]}, device, graph)
        samples = _ort_peer.time_runs(call, device, graph, warmup=args.warmup, replays=args.replays,
                                      batches=args.batches)
    except _ort_peer.Unavailable as exc:
        raise Skip(str(exc)) from None
    how = ("CUDA graph replays (enable_cuda_graph=1)" if graph else "no CUDA graph") if device.type == "cuda" \
        else "CPUExecutionProvider"
    res = {"ms": statistics.median(samples), "samples_ms": [round(v, 5) for v in samples],
           "timing": f"{how}, run_with_iobinding unsynchronized, wall clock around {args.replays} runs with a "
                     f"device sync, median of {args.batches}"}
    return res, out.clone()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def tqdm_write(msg: str) -> None:
    importlib.import_module("tqdm").tqdm.write(msg, file=sys.stderr)


def row_head(c: Case, args) -> dict:
    return {"name": c.name, "config": asdict(c) | {"capacity": c.capacity, "prefill": c.prefill},
            **floor_ms(c, args.bandwidth, args.tflops), "arms": {}, "ratios": {}, "parity": {}}


def run_row(c: Case, args, device: torch.device) -> dict:
    from pagedkit.validators import check_inputs

    args.row, row = c.name, row_head(c, args)
    base, attrs = build_inputs(c, device, args.seed)
    issues = check_inputs(base, attrs, op_type="GroupQueryAttention", outputs=OUTPUTS, node_name=c.name)
    if issues:  # safe_row records it as the row's error
        raise ValueError("pagedkit's validator rejects the inputs: " + "; ".join(map(str, issues))[:400])
    row["config"]["attributes"] = attrs
    outs = {}
    for arm in ("triton_gqa", "ort", "ort_no_graph"):
        if arm == "ort_no_graph" and (device.type == "cpu" or "skipped" not in row["arms"]["ort"]):
            continue  # only when the graph arm fails
        try:
            if arm == "triton_gqa":
                res, outs[arm] = triton_arm(base, attrs, args, device)
            else:
                res, outs[arm] = ort_arm(base, attrs, args, device, graph=arm == "ort" and device.type == "cuda")
        except Skip as exc:
            res = {"skipped": str(exc)}
            tqdm_write(f"[{c.name}] {arm}: skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            res = {"skipped": f"error: {one_line(exc)}"}
            tqdm_write(f"[{c.name}] {arm}: {res['skipped']}")
        if "ms" in res:
            res["fraction_of_floor"] = row["floor_ms"] / res["ms"]
            res["tb_s"] = row["bytes"]["total"] / (res["ms"] * 1e-3) / 1e12
            if c.prefill:
                res["tflop_s"] = row["flops"] / (res["ms"] * 1e-3) / 1e12
        row["arms"][arm] = res
        free(device)
    for ref in ("ort", "ort_no_graph"):
        if "triton_gqa" in outs and ref in outs:
            err = row["parity"][f"triton_gqa_vs_{ref}"] = rel_err(outs["triton_gqa"], outs[ref])
            if not err <= PARITY_WARN:  # NaN too
                row.setdefault("parity_warnings", []).append(f"triton_gqa vs {ref}: {err:.3g}")
                tqdm_write(f"!!! [{c.name}] PARITY: triton_gqa vs {ref} max|diff|/max|ref| = {err:.3g} > {PARITY_WARN}")
        ms, mr = row["arms"]["triton_gqa"].get("ms"), row["arms"].get(ref, {}).get("ms")
        if ms and mr:
            row["ratios"][f"triton_gqa_speedup_vs_{ref}"] = mr / ms
    return row


def safe_row(c: Case, args, device: torch.device) -> dict:
    try:
        return run_row(c, args, device)
    except Exception as exc:  # noqa: BLE001 - the row's one-line error; the run goes on
        tqdm_write(f"[{c.name}] error: {one_line(exc)}")
        return row_head(c, args) | {"error": one_line(exc)}
    finally:
        free(device)


def summary_line(r: dict) -> str:
    cells = [f"{r['name']:28} floor {r['floor_ms']:.4g} ms"]
    for a, res in r["arms"].items():
        rate = f"{res['tflop_s']:.3g} TF/s" if "tflop_s" in res else f"{res.get('tb_s', 0):.3g} TB/s"
        cells.append(f"{a} {res['ms']:.4g} ms {rate} ({res['fraction_of_floor']:.0%} of floor)" if "ms" in res
                     else f"{a} skipped")
    cells += [f"{k}={v:.3g}" for k, v in (r["ratios"] | r["parity"]).items()]
    return " | ".join(cells + ([f"ERROR {r['error']}"] if "error" in r else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results", help="folder of attention_gqa.json")
    ap.add_argument("--cases", nargs="+", metavar="NAME", help="rows to run (names or fnmatch patterns; --list)")
    ap.add_argument("--list", action="store_true", help="list the rows and exit")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, eager Triton interpreter, ORT CPU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--replays", type=int, default=20, help="calls per timed batch (graph replays, ORT runs)")
    ap.add_argument("--batches", type=int, default=10, help="timed batches; the median is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bandwidth", type=float, default=BANDWIDTH_TB_S, help="TB/s of the floor")
    ap.add_argument("--tflops", type=float, default=PEAK_TFLOP_S, help="TFLOP/s of prefill rows' floor")
    args = ap.parse_args(argv)
    table = DRY_CASES if args.dry_run else CASES
    if args.list:
        for c in table.values():
            print(f"{c.name:28} B {c.batch} context {c.context} S {c.seq} capacity {c.capacity} H {c.num_heads}/"
                  f"{c.kv_heads} D {c.head_size} {c.dtype} cache {c.cache} {c.quant}")
        return 0
    if args.cases:
        names = [n for n in table if any(fnmatch.fnmatch(n, p) for p in args.cases)]
        if not names:
            sys.exit(f"--cases {args.cases}: no row matches; rows: {', '.join(table)}")
    else:
        names = list(QUICK if args.quick and not args.dry_run else table)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before pagedkit's Triton kernels import
        args.warmup, args.replays, args.batches = 1, 1, 3
        device = torch.device("cpu")
        device_name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    elif not torch.cuda.is_available():
        sys.exit("no CUDA device: run on the H200, or --dry-run for the CPU plumbing check")
    else:
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
    from tqdm import tqdm

    rows = [safe_row(table[n], args, device) for n in tqdm(names, desc="gqa rows", unit="row")]
    result = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]), "device": device_name,
              "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "dry_run": args.dry_run,
              "versions": versions(), "bandwidth_tb_s": args.bandwidth, "tflops": args.tflops,
              "floor_note": "decode: bytes that must move / bandwidth; prefill: max(that, causal FLOPs / tflops)",
              "settings": {"warmup": args.warmup, "replays": args.replays, "batches": args.batches,
                           "seed": args.seed, "parity_warn": PARITY_WARN, "outputs": OUTPUTS},
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attention_gqa.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(summary_line(r))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
