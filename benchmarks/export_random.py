"""Export of a random-weights model (no checkpoint): wall time and peak memory of `paged-export`, against the
eager path (transformers' from_config drawing every weight in memory, then the export) and the floor (the bytes
written over this disk's sequential write bandwidth, measured here by writing as many bytes).

    python benchmarks/export_random.py --model deepseek-v2-lite --dtype bf16 --block-size 64 \
        --arms lazy eager:2 --out benchmarks/results/export_random.json

An arm is `lazy` (the default export: random_weights.py, drawn while written) or `eager`, each optionally
`:N` (--num-layers N; the eager path holds the whole model in memory, so a full-shape eager arm needs its
size in RAM). Each arm runs in its own process (peak RSS from getrusage of that child) into a temporary folder
removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _provenance import versions, write_result  # noqa: E402

RUN = ("import resource, sys\n"
       "from pagedkit.exporters.cli import main\n"
       "try:\n    rc = main(sys.argv[1:])\n"
       "finally:\n    print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
       "sys.exit(rc)\n")
LAZY = RUN
EAGER = ("from pagedkit.exporters import random_weights as rw\n"
         "def refuse(*a, **k): raise rw.RandomInitUnsupported('benchmark: the eager path')\n"
         "rw._record = refuse\n" + RUN)


def write_bandwidth(folder: Path, nbytes: int) -> float:
    """Sequential write bandwidth (bytes/s) of `folder`'s disk: nbytes in 64 MiB writes, fsync'd."""
    chunk = os.urandom(1 << 20) * 64
    path = folder / "bandwidth.tmp"
    start = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(chunk[:min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - start
    path.unlink()
    return nbytes / took


def run_arm(arm: str, args, work: Path) -> dict:
    kind, _, layers = arm.partition(":")
    out = work / f"out_{kind}_{layers or 'all'}"
    argv = ["--model", args.model, "--dtype", args.dtype, "--block-size", str(args.block_size), "--output", str(out),
            "--quiet"] + (["--num-layers", layers] if layers else [])
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", EAGER if kind == "eager" else LAZY] + argv,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    rss = next((int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("peak_rss_kib")), 0)
    if done.returncode != 0:
        raise SystemExit(f"{arm}: paged-export failed: {done.stderr.strip().splitlines()[-1:]}")
    files = [p for p in out.iterdir() if p.name.startswith("model.onnx")]
    nbytes = sum(p.stat().st_size for p in files)
    floor = nbytes / args.write_bw
    shutil.rmtree(out)
    summary = [line.strip() for line in done.stdout.splitlines() if "parameters" in line]
    return {"arm": arm, "path": kind, "num_layers": int(layers) if layers else None, "seconds": round(seconds, 2),
            "bytes_written": nbytes, "write_floor_s": round(floor, 2), "fraction_of_floor": round(floor / seconds, 3),
            "peak_rss_mib": round(rss / 1024, 1), "summary": summary}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v2-lite")
    ap.add_argument("--dtype", default="bf16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--arms", nargs="+", default=["lazy", "eager:2", "lazy:2"])
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--bw-bytes", type=int, default=2 << 30, help="bytes written to measure the disk (2 GiB)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(dir=args.work))
    try:
        args.write_bw = write_bandwidth(work, args.bw_bytes)
        print(f"disk sequential write: {args.write_bw / 1e9:.2f} GB/s")
        rows = []
        for arm in args.arms:
            rows.append(run_arm(arm, args, work))
            r = rows[-1]
            print(f"{arm:>10}: {r['seconds']:8.1f} s  {r['bytes_written'] / 2**20:10,.0f} MiB  floor "
                  f"{r['write_floor_s']:6.1f} s ({r['fraction_of_floor']:.0%})  peak RSS {r['peak_rss_mib']:,.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"command": "python benchmarks/export_random.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "device": "cpu", "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "floor": "bytes written / this disk's measured sequential write bandwidth",
              "write_bandwidth_gb_s": round(args.write_bw / 1e9, 3), "rows": rows,
              "note": "peak_rss_mib: the export process's own getrusage(RUSAGE_SELF).ru_maxrss",
              "versions": versions(("transformers", "torch", "pagedkit"))}
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
