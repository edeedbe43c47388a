"""`paged-rewrite IN.onnx OUT.onnx --to paged|gqa|decomposed [--block-size N]`.

Prints what changed; validates the output; on refusal (a feature the target operator lacks, an unsafe or
malformed input) exits non-zero with one line on stderr (pagedkit/cli_errors.py: 2 bad input or refused,
1 the rewritten model failed validation, 3 internal error).
"""

from __future__ import annotations

import argparse
from typing import Sequence

from pagedkit.cli_errors import EXIT_FAILED, EXIT_OK, cli_main, report as report_error
from pagedkit.validators.contract import block_size_error

PROG = "paged-rewrite"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=(
        "Rewrite an ONNX model between GroupQueryAttention and PagedAttention (onnxruntime-genai layouts), or "
        "decompose PagedAttention into standard ONNX ops. genai_config.json beside IN is rewritten beside OUT."))
    p.add_argument("input", help="the model (.onnx file, or its folder)")
    p.add_argument("output", help="the rewritten model (.onnx); external data and genai_config.json go beside it")
    p.add_argument("--to", required=True, choices=("paged", "gqa", "decomposed"), help="target layout")
    p.add_argument("--block-size", type=int, default=None,
                   help="--to paged: block size written to genai_config.json (a power of two >= 16; default 256, "
                        "as onnxruntime-genai's builder)")
    return p


@cli_main(PROG)
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.block_size is not None:
        err = block_size_error(args.block_size)
        if err:
            raise ValueError(err)
    from .rewrite import RewriteInvalid, rewrite_file

    try:
        report = rewrite_file(args.input, args.output, args.to, block_size=args.block_size)
    except RewriteInvalid as exc:
        report_error(PROG, ValueError(str(exc)))
        return EXIT_FAILED
    print(report)
    print(f"OK: {args.output} validated")
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
