"""`paged-serve`: an OpenAI-compatible HTTP server (completions, chat completions, streaming) over a model
folder, on pagedkit's engine (continuous batching) with starlette + uvicorn.

    paged-serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [--device cpu|cuda]
                          [--max-batch-size N] [--max-num-tokens N] [--num-blocks N] [--kv-memory-fraction F]
                          [--api-key KEY] [--allowed-hosts NAME ...] [--allowed-origins ORIGIN ...]
                          [--tool-call-parser hermes|llama3_json|mistral]
                          [limits: --max-body-bytes, --request-timeout, --max-queue-len, ... (docs/serve.md)]

MODEL_DIR holds model.onnx, genai_config.json and the tokenizer (tokenizer.json, tokenizer_config.json
with the chat template, as paged-export copies them). The model's name in the API (`model`) is the
folder's name. Needs `pip install "pagedkit[serve,export]"`. Exit status: 2 bad arguments (a --host /
--port it cannot listen on included) or model (one line on stderr, no traceback); the server runs until
Ctrl-C. The KV pool it allocated is printed at start. See docs/serve.md.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from ... import settings
from ...cli_errors import cli_main, folder_problem
from .limits import ServeLimits

PROG = "paged-serve"
_DEFAULTS = ServeLimits()
# flag, ServeLimits field, type, smallest value, help ("0" for a timeout: none)
LIMIT_FLAGS = (
    ("--max-body-bytes", "max_body_bytes", int, 1, "largest request body; 413 above, refused before it is read whole"),
    ("--max-json-depth", "max_json_depth", int, 1, "deepest nesting of a request's JSON; 400 above"),
    ("--max-stop-strings", "max_stop_strings", int, 1, "most stop strings in one request; 400 above"),
    ("--max-stop-length", "max_stop_length", int, 1, "most characters in one stop string; 400 above"),
    ("--max-queue-len", "max_queue_len", int, 0, "most requests waiting beyond the engine's batch; 429 above"),
    ("--retry-after", "retry_after_s", int, 0, "the Retry-After (seconds) of a 429"),
    ("--request-timeout", "request_timeout_s", float, 0,
     "seconds a request may run (then finish_reason length); its max_time may lower it; 0: none"),
    ("--header-timeout", "header_timeout_s", float, 0, "seconds for a request line and headers; 0: none"),
    ("--body-timeout", "body_timeout_s", float, 0, "seconds for a request body once its headers came (408); 0: none"),
    ("--keep-alive-timeout", "keep_alive_timeout_s", float, 0, "seconds an idle keep-alive connection is kept"),
    ("--max-header-bytes", "max_header_bytes", int, 1, "largest request line + headers; 400 above"),
    ("--limit-concurrency", "limit_concurrency", int, 1, "most connections + requests at once; 503 above"),
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="folder with model.onnx, genai_config.json and tokenizer.json")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-num-tokens", type=int, default=512, help="tokens per engine step (default 512)")
    p.add_argument("--num-blocks", type=int, help="KV cache blocks (default: sized from the free memory, below)")
    p.add_argument("--kv-memory-fraction", type=float,
                   help="fraction of the free memory the default KV pool may take (default: 0.25 of the available "
                        "RAM on cpu, 0.9 of the free GPU memory on cuda)")
    p.add_argument("--model-name", help="the model's id in the API (default: the folder's name)")
    p.add_argument("--tp", type=int, metavar="N",
                   help="serve a tensor-parallel export (paged-export --tp N) on N ranks started here: this process "
                        "(HTTP server, scheduler, tokenizer) is rank 0 (default: the folder's own world size)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: $PAGEDKIT_API_KEY; "
                                     "none: no authentication)")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="Host header names served besides the loopback names of a loopback bind (a bind on "
                        "another address checks Host only when this is given)")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="CORS origins allowed (e.g. http://localhost:3000); default: none, no CORS headers")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"],
                   help="the format of the model's tool calls (default: chosen from the chat template; docs/serve.md)")
    for flag, field, kind, lo, text in LIMIT_FLAGS:
        p.add_argument(flag, type=kind, default=getattr(_DEFAULTS, field), dest=field,
                       help=f"{text} (default {getattr(_DEFAULTS, field)})")
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
    for flag, field, kind, lo, _ in LIMIT_FLAGS:
        value = getattr(args, field)
        if not value >= lo or value == float("inf"):
            return f"{flag}: expected {'an integer' if kind is int else 'a number'} >= {lo}, got {value}"
    fraction = args.kv_memory_fraction
    if fraction is not None and not 0 < fraction <= 1:
        return f"--kv-memory-fraction: expected a number in (0, 1], got {fraction}"
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
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn

    tokenizer = load_tokenizer(model_dir)  # before the engine: a folder without tokenizer fails fast
    from ...engine import Engine

    engine = Engine(model_dir, device=args.device, max_batch_size=args.max_batch_size,
                    max_num_tokens=args.max_num_tokens, num_blocks=args.num_blocks,
                    memory_fraction=args.kv_memory_fraction, tp=args.tp)
    from .app import create_app
    from .connections import uvicorn_config
    from .security import allowed_hosts_for, api_key_from_env

    name = args.model_name or model_dir.resolve().name
    limits = ServeLimits(**{field: getattr(args, field) for _, field, *_ in LIMIT_FLAGS})
    api_key = args.api_key or api_key_from_env()
    app = create_app(engine, tokenizer, name, limits=limits, api_key=api_key,
                     allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
                     allowed_origins=args.allowed_origins, tool_call_parser=args.tool_call_parser)
    print(f"{PROG}: {engine.model.pool_summary()}", file=sys.stderr)
    print(f"{PROG}: serving {name!r} ({model_dir}) on http://{args.host}:{args.port}/v1 ({args.device}"
          f"{', API key required' if api_key else ''})", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, args.host, args.port, limits, args.log_level)).run()
    finally:
        engine.close()  # a tensor-parallel engine's followers
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
