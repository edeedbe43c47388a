"""Serve an exported model over pagedkit's OpenAI-compatible endpoint and send it concurrent chat prompts.

    pip install torch==2.13.0 -e ".[export,serve]"
    paged-fetch smollm2-135m && paged-export --model smollm2-135m --output smollm2-fp16
    python examples/serve_exported_model.py smollm2-fp16 --prompts 8 --max-tokens 32

It starts `paged-serve`'s app (continuous batching on pagedkit.engine.Engine) on a free local port,
posts `--prompts` chat completions at once from as many threads, prints the start of each answer and the
throughput (completion tokens over the wall time of the whole batch), and stops the server. CPU unless
`--device cuda`.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from pathlib import Path

QUESTIONS = ["What is a printing press?", "Name three colours.", "Why is the sky blue?", "What is 2 + 2?",
             "Describe a cat.", "What is a river?", "Say hello in French.", "What is the Moon?"]


def serve_and_ask(model_dir: Path, prompts: int = 8, max_tokens: int = 32, device: str = "cpu",
                  max_batch_size: int = 8) -> dict:
    import httpx
    import uvicorn

    from pagedkit.engine import Engine
    from pagedkit.apps.serve import create_app
    from pagedkit.apps.serve.tokenizer import load_tokenizer

    engine = Engine(model_dir, device=device, max_batch_size=max_batch_size, max_num_tokens=512)
    app = create_app(engine, load_tokenizer(model_dir), "model")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/chat/completions"
    answers: list[dict | None] = [None] * prompts
    start = threading.Barrier(prompts)  # every client connected first, then all requests sent at once

    def ask(i: int) -> None:
        body = {"model": "model", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}
        with httpx.Client(timeout=600) as client:
            start.wait(timeout=60)
            answers[i] = client.post(url, json=body).raise_for_status().json()

    try:
        t0 = time.perf_counter()
        workers = [threading.Thread(target=ask, args=(i,)) for i in range(prompts)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    if any(a is None for a in answers):
        raise RuntimeError("a request failed (see the server's log above)")
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    for i, a in enumerate(answers):
        text = a["choices"][0]["message"]["content"].replace("\n", " ")
        print(f"[{i}] {QUESTIONS[i % len(QUESTIONS)]!r} -> {text[:60]!r}")
    summary = {"prompts": prompts, "completion_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
               "max_batch": engine.stats.max_batch}
    print(f"{prompts} concurrent requests, {tokens} completion tokens in {wall:.2f} s: {tokens / wall:.1f} tokens/s "
          f"(largest batch {engine.stats.max_batch})")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path, help="an exported model folder with its tokenizer (paged-export)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = ap.parse_args(argv)
    serve_and_ask(args.model_dir, args.prompts, args.max_tokens, args.device, max_batch_size=args.prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
