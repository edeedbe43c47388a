"""`paged-serve`: an OpenAI-compatible HTTP server (completions, chat completions, streaming) over a model
folder, on pagedkit's engine (continuous batching) with starlette + uvicorn.

    paged-serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--device cpu|cuda]
                          [--max-batch-size N] [--max-num-tokens N] [--num-blocks N]

MODEL_DIR holds model.onnx, genai_config.json and the tokenizer (tokenizer.json, tokenizer_config.json
with the chat template, as paged-export copies them). The model's name in the API (`model`) is the
folder's name. Needs `pip install "pagedkit[serve,export]"`. Exit status: 2 bad arguments (a --host /
--port it cannot listen on included) or model (one line on stderr, no traceback); the server runs until
Ctrl-C. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from ... import settings
from ...cli_errors import cli_main, folder_problem

PROG = "paged-serve"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="folder with model.onnx, genai_config.json and tokenizer.json")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens per engine step (default 512)")
    p.add_argument("--num-blocks", type=int, help="KV cache blocks (default: the engine's sizing)")
    p.add_argument("--model-name", help="the model's id in the API (default: the folder's name)")
    p.add_argument("--tp", type=int, metavar="N",
                   help="serve a tensor-parallel export (paged-export --tp N) on N ranks started here: this process "
                        "(HTTP server, scheduler, tokenizer) is rank 0 (default: the folder's own world size)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _listen_problem(host: str, port: int) -> str | None:
    """Why uvicorn could not listen on host:port (an unknown host, a port in use...), else None: checked by
    binding (with asyncio's socket options) and closing every address the host resolves to."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError as exc:
        return f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})"
    return None


def _check_args(args) -> str | None:
    if not 0 <= args.port <= 65535:
        return f"--port: expected 0..65535, got {args.port}"
    for name in ("max_batch_size", "max_num_tokens", "num_blocks", "tp"):
        value = getattr(args, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')}: expected an integer >= 1, got {value}"
    return _listen_problem(args.host, args.port)  # uvicorn would log it and exit 3 (pagedkit's internal error)


@cli_main(PROG)
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings.stay_offline("HF_HUB_OFFLINE")
    model_dir = Path(args.model_dir)
    problem = _check_args(args) or folder_problem(model_dir, "model.onnx, genai_config.json and tokenizer.json")
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(f"{PROG}: error: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    from .tokenizer import load_tokenizer, missing_tokenizer

    problem = missing_tokenizer(model_dir)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    # before the engine loads: a missing one is cli_errors' one line naming the extra (pagedkit[serve])
    import starlette  # noqa: F401
    import uvicorn

    tokenizer = load_tokenizer(model_dir)  # before the engine: a folder without tokenizer fails fast
    from ...engine import Engine

    engine = Engine(model_dir, device=args.device, max_batch_size=args.max_batch_size,
                    max_num_tokens=args.max_num_tokens, num_blocks=args.num_blocks, tp=args.tp)
    from .app import create_app

    name = args.model_name or model_dir.resolve().name
    app = create_app(engine, tokenizer, name)
    print(f"{PROG}: serving {name!r} ({model_dir}) on http://{args.host}:{args.port}/v1 ({args.device})",
          file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()  # a tensor-parallel engine's followers
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
