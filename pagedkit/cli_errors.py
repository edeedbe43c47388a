"""One way for the CLIs (paged-validate, paged-run, paged-export) to turn errors into one stderr line and an
exit status, never a traceback for bad input.

Exit statuses shared by the three commands:

    0  success
    1  the command ran and the result failed its check (validate: issues; run: parity failure;
       export: the exported model is invalid)
    2  bad input: bad arguments, a missing / unreadable / malformed model, folder, config or
       checkpoint, a path leading outside the model folder, a missing optional dependency
    3  internal error: an exception pagedkit does not expect (a bug: please report it)

Known error types (bad input, status 2): ValueError (pagedkit's ValidationError, ModelLoadError,
UnsafeModelError, UnsafePathError, WeightsError; json.JSONDecodeError, UnicodeDecodeError), OSError
(missing files, permissions), protobuf's DecodeError (not an ONNX file), NotImplementedError (an
unsupported model) and a missing optional package (ModuleNotFoundError: which extra to install).
Anything else is status 3 with a one-line summary. `PAGEDKIT_DEBUG=1` in the environment re-raises every
error instead (full traceback), so that CI and bug reports still see the stack.
"""

from __future__ import annotations

import functools
import sys
from typing import Callable, Sequence

from . import settings

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 3

# top-level module -> the pagedkit extra that installs it
EXTRAS = {"transformers": "export", "safetensors": "export", "gguf": "export", "accelerate": "export",
          "tokenizers": "export", "huggingface_hub": "export", "onnxruntime": "test", "triton": "triton-cpu",
          "starlette": "serve", "uvicorn": "serve", "prometheus_client": "serve", "tqdm": "bench",
          "matplotlib": "bench"}


def debug() -> bool:
    """PAGEDKIT_DEBUG on (docs/settings.md): re-raise instead of one line."""
    return settings.read("PAGEDKIT_DEBUG")


def one_line(text: str) -> str:
    """text with its lines joined by '; ' (messages that list several problems stay on one line)."""
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip())


def missing_extra(exc: BaseException) -> str | None:
    """For an ImportError of an optional package: the message saying which extra to install."""
    if not isinstance(exc, ImportError):
        return None
    top = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRAS.get(top)
    if extra is None:
        return None
    return f"this needs the optional package {top!r}: pip install \"pagedkit[{extra}]\""


def _decode_error_types() -> tuple[type, ...]:
    try:
        from google.protobuf.message import DecodeError
    except ImportError:  # pragma: no cover - protobuf comes with onnx
        return ()
    return (DecodeError,)


def describe(exc: BaseException) -> tuple[str, int]:
    """(one-line message, exit status) for an exception raised by a CLI."""
    extra = missing_extra(exc)
    if extra is not None:
        return extra, EXIT_BAD_INPUT
    if isinstance(exc, (OSError, ValueError, NotImplementedError) + _decode_error_types()):
        text = one_line(str(exc)) or type(exc).__name__
        plain = type(exc) in (ValueError, NotImplementedError) or type(exc).__module__.startswith("pagedkit")
        return (text if plain else f"{type(exc).__name__}: {text}"), EXIT_BAD_INPUT
    return (f"internal error: {type(exc).__name__}: {one_line(str(exc))} (a bug in pagedkit: please report it; "
            "PAGEDKIT_DEBUG=1 shows the traceback)"), EXIT_INTERNAL


def report(prog: str, exc: BaseException) -> int:
    """Print `prog: error: <one line>` on stderr; returns the exit status (re-raises when debug())."""
    if debug():
        raise exc
    message, status = describe(exc)
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def cli_main(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorator for a CLI `main(argv) -> int`: SystemExit (argparse) passes through, Ctrl-C is status
    130, every other exception becomes one stderr line and an exit status (see `describe`)."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(argv: Sequence[str] | None = None) -> int:
            try:
                return main(argv)
            except KeyboardInterrupt:
                if debug():
                    raise
                print(f"\n{prog}: interrupted", file=sys.stderr)
                return 130
            except Exception as exc:
                return report(prog, exc)

        return run

    return wrap


def folder_problem(path, expected: str) -> str | None:
    """A CLI's MODEL_DIR check: None when `path` is a folder, else the one-line reason naming what it should hold."""
    from pathlib import Path

    return None if Path(path).is_dir() else f"{path}: not a folder (expected a model folder with {expected})"

