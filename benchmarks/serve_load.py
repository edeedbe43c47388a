"""paged-serve under load: an OpenAI-client load generator against a `paged-serve` process.

    python benchmarks/serve_load.py MODEL_DIR [--requests 200] [--rate 4] [--disconnect 0.1] [--out benchmarks/results]
    python benchmarks/serve_load.py --tiny ...        # a tiny random Llama exported on the spot (a smoke run)

Starts `paged-serve MODEL_DIR` (extra server flags after `--`), then sends `--requests` requests with Poisson
arrivals (exponential gaps, mean 1 / `--rate` s) through `openai.AsyncOpenAI`: completions and chat, every one
streamed (so each token's arrival is seen), prompt lengths drawn from 8..`--max-prompt` words and output lengths
from 8..`--max-tokens` tokens (log-uniform), `ignore_eos` so that the output length is the one drawn; a share
`--disconnect` of the clients closes its stream after a few chunks (the server must abort those requests).
Before the load, `--warmup` requests run one at a time (the server's RSS "after warm-up" is read after them).

Reports: requests/s (completed requests over the load's wall time) and output tokens/s; time to first token
and inter-token latency (the gaps between a stream's content chunks, per token) p50 / p99 over the completed
streams; errors; the server's RSS (psutil, sampled every 50 ms): after warm-up, peak during the load, and after
the load once the server is idle again (`--settle` s); `rss_returned` says whether it came back within 5% of
the warm-up figure; the server's /metrics at the end (requests finished by reason, preemptions, KV usage).
Writes serve_load.json (+ serve_load.png: RSS and requests in flight over time, TTFT / ITL distributions) to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

WORDS = ("the of and to in is was for on with as by at from that this it be are an or which one all were "
         "their has have more time year people world city water history music science language river").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler(threading.Thread):
    """The server process's RSS every `period` s: (time, bytes) samples; `mark(name)` records the latest one."""

    def __init__(self, pid: int, period: float = 0.05):
        super().__init__(daemon=True)
        import psutil

        self.proc, self.period = psutil.Process(pid), period
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.t0 = time.monotonic()
        self.warm = 0  # the RSS after the warm-up requests

    def run(self):
        while not self.stop.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.proc.memory_info().rss))
            except Exception:  # noqa: BLE001 - the process ended
                return
            time.sleep(self.period)

    def now(self) -> int:
        return self.proc.memory_info().rss

    def peak(self, since: float) -> int:
        return max((r for t, r in self.samples if t >= since - self.t0), default=0)


def percentile(values, q):
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def make_request(rng: random.Random, i: int, args) -> dict:
    words = int(round(math.exp(rng.uniform(math.log(8), math.log(args.max_prompt)))))
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    tokens = int(round(math.exp(rng.uniform(math.log(8), math.log(args.max_tokens)))))
    chat = i % 2 == 1
    req = {"max_tokens": tokens, "temperature": 0.0 if i % 3 else 0.8, "seed": i, "stream": True,
           "extra_body": {"ignore_eos": True}}
    if chat:
        req["messages"] = [{"role": "user", "content": text}]
    else:
        req["prompt"] = text
    return {"chat": chat, "body": req, "disconnect": rng.random() < args.disconnect, "words": words}


async def one_request(client, model: str, spec: dict, record: dict, sampler: RssSampler) -> None:
    body = dict(spec["body"])
    t0 = time.monotonic()
    record.update(start=t0 - sampler.t0, chat=spec["chat"], max_tokens=body["max_tokens"], disconnect=spec["disconnect"])
    stamps, chunks = [], 0
    try:
        if spec["chat"]:
            stream = await client.chat.completions.create(model=model, **body)
        else:
            stream = await client.completions.create(model=model, **body)
        async for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            piece = (c.delta.content if spec["chat"] else c.text) or ""
            if piece:
                stamps.append(time.monotonic())
                chunks += 1
            if spec["disconnect"] and chunks >= 3:
                await stream.close()
                record["outcome"] = "disconnected"
                return
        record["outcome"] = "completed"
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
        record["outcome"] = f"error: {type(exc).__name__}: {exc}"[:300]
        return
    finally:
        record["end"] = time.monotonic() - sampler.t0
    if stamps:
        record["ttft"] = stamps[0] - t0
        record["itl"] = [b - a for a, b in zip(stamps, stamps[1:])]
        record["chunks"] = len(stamps)


async def load(args, url: str, model: str, sampler: RssSampler) -> tuple[list[dict], float, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    rng = random.Random(args.seed)
    for i in range(args.warmup):  # one at a time
        rec: dict = {}
        await one_request(client, model, make_request(rng, 10_000 + i, args) | {"disconnect": False}, rec, sampler)
    await asyncio.sleep(1.0)
    sampler.warm = sampler.now()
    specs = [make_request(rng, i, args) for i in range(args.requests)]
    records = [{} for _ in specs]
    tasks = []
    start = time.monotonic()
    for spec, rec in zip(specs, records):
        tasks.append(asyncio.create_task(one_request(client, model, spec, rec, sampler)))
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    end = time.monotonic()
    await client.close()
    return records, start, end


def tiny_model_dir() -> Path:
    sys.path.insert(0, str(REPO / "tests"))
    from test_serve_helpers import tiny_served_model

    folder = Path(tempfile.mkdtemp(prefix="serve_load_")) / "tiny-llama"
    return tiny_served_model(folder)


def metrics_text(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def plot(result: dict, samples, records, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    t = [s[0] for s in samples]
    ax1.plot(t, [s[1] / 2 ** 20 for s in samples], label="server RSS (MiB)")
    ax1.axhline(result["rss_after_warmup_mib"] * 1.05, ls=":", c="gray", label="warm-up RSS + 5%")
    ax1.set_xlabel("time (s)")
    ax1.set_ylabel("MiB")
    ax1b = ax1.twinx()
    edges = sorted({r["start"] for r in records} | {r["end"] for r in records if "end" in r})
    ax1b.step(edges, [sum(r["start"] <= e < r.get("end", 1e9) for r in records) for e in edges], where="post",
              c="tab:orange", alpha=0.6, label="requests in flight")
    ax1b.set_ylabel("requests in flight")
    ax1.legend(loc="upper left", fontsize=8)
    ax1b.legend(loc="lower right", fontsize=8)
    ax1.set_title(f"{result['model']}: {result['requests']} requests, Poisson {result['rate']}/s")
    ttft = sorted(r["ttft"] * 1e3 for r in records if r.get("outcome") == "completed" and "ttft" in r)
    itl = sorted(x * 1e3 for r in records if r.get("outcome") == "completed" for x in r.get("itl", []))
    for data, label in ((ttft, "time to first token"), (itl, "inter-token latency")):
        if data:
            ax2.plot(data, [k / len(data) for k in range(len(data))], label=label)
    ax2.set_xscale("log")
    ax2.set_xlabel("ms")
    ax2.set_ylabel("fraction of requests / gaps")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("model_dir", nargs="?", help="a paged-export folder (or --tiny)")
    ap.add_argument("--tiny", action="store_true", help="export a tiny random Llama and serve it")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of clients that leave midway")
    ap.add_argument("--max-prompt", type=int, default=None, help="most prompt words (400; --tiny: 60)")
    ap.add_argument("--max-tokens", type=int, default=None, help="most output tokens (128; --tiny: 64)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--settle", type=float, default=5.0, help="seconds idle before the after-load RSS")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--name", default="serve_load", help="result file stem")
    args, server_flags = ap.parse_known_args(argv)
    server_flags = [f for f in server_flags if f != "--"]
    if not args.tiny and not args.model_dir:
        ap.error("MODEL_DIR or --tiny")
    args.max_prompt = args.max_prompt or (60 if args.tiny else 400)
    args.max_tokens = args.max_tokens or (64 if args.tiny else 128)
    model_dir = tiny_model_dir() if args.tiny else Path(args.model_dir)
    port = free_port()
    argv_srv = [sys.executable, "-m", "pagedkit.apps.serve.cli", str(model_dir), "--port", str(port),
                "--log-level", "warning", *server_flags]
    env = os.environ | {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = open(Path(tempfile.gettempdir()) / f"serve_load_{port}.log", "w")
    proc = subprocess.Popen(argv_srv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"paged-serve exited: see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("paged-serve did not come up")
            time.sleep(0.5)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        sampler = RssSampler(proc.pid)
        sampler.start()
        rss_start = sampler.now()
        records, start, end = asyncio.run(load(args, url, model, sampler))
        rss_warm = sampler.warm
        peak = sampler.peak(start)
        time.sleep(args.settle)
        while httpx.get(f"{url}/health").json()["pending_requests"]:
            time.sleep(0.2)
        rss_after = sampler.now()
        metrics = metrics_text(url)
        sampler.stop.set()
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    done = [r for r in records if r.get("outcome") == "completed"]
    errors = [r["outcome"] for r in records if str(r.get("outcome", "")).startswith("error")]
    ttft = [r["ttft"] for r in done if "ttft" in r]
    itl = [x for r in done for x in r.get("itl", [])]
    wall = end - start
    from _provenance import versions

    result = {
        "model": model, "model_dir": str(model_dir), "server_flags": server_flags, "requests": args.requests,
        "rate": args.rate, "disconnect_share": args.disconnect, "max_prompt_words": args.max_prompt,
        "max_tokens": args.max_tokens, "seed": args.seed,
        "completed": len(done), "disconnected": sum(r.get("outcome") == "disconnected" for r in records),
        "errors": len(errors), "error_examples": errors[:5], "wall_s": round(wall, 3),
        "requests_per_s": round(len(done) / wall, 3),
        "output_tokens_per_s": round(sum(r.get("chunks", 0) for r in records) / wall, 2),
        "ttft_ms": {"p50": _ms(percentile(ttft, 50)), "p99": _ms(percentile(ttft, 99))},
        "itl_ms": {"p50": _ms(percentile(itl, 50)), "p99": _ms(percentile(itl, 99))},
        "rss_start_mib": _mib(rss_start), "rss_after_warmup_mib": _mib(rss_warm), "rss_peak_mib": _mib(peak),
        "rss_after_load_mib": _mib(rss_after),
        "rss_returned": abs(rss_after - rss_warm) <= 0.05 * rss_warm,
        "server_metrics": {k: v for k, v in metrics.items() if k.startswith("paged_serve_") and not k.endswith("_sum")},
        "versions": versions(("onnxruntime", "pagedkit", "openai")),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, sampler.samples, records, out / f"{args.name}.png")
    print(json.dumps({k: result[k] for k in ("model", "completed", "disconnected", "errors", "requests_per_s",
                                             "output_tokens_per_s", "ttft_ms", "itl_ms", "rss_after_warmup_mib",
                                             "rss_peak_mib", "rss_after_load_mib", "rss_returned")}, indent=1))
    return 0 if result["rss_returned"] and not errors else 1


def _ms(x):
    return None if x is None else round(x * 1e3, 2)


def _mib(x):
    return round(x / 2 ** 20, 1)


if __name__ == "__main__":
    sys.exit(main())
