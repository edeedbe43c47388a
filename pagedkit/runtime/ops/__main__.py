"""python -m pagedkit.runtime.ops [--write-doc PATH]: print the supported-op table, or rewrite the
generated section of docs/runtime-ops.md (between <!-- ops:begin --> and <!-- ops:end -->)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from . import supported_ops_markdown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkit.runtime.ops", description=__doc__)
    p.add_argument("--write-doc", metavar="PATH", nargs="?", const="docs/runtime-ops.md",
                   help="rewrite the generated op list in this markdown file (default docs/runtime-ops.md)")
    args = p.parse_args(argv)
    table = supported_ops_markdown()
    if not args.write_doc:
        print(table, end="")
        return 0
    path = Path(args.write_doc)
    text = path.read_text()
    new, n = re.subn(r"(<!-- ops:begin -->\n).*?(<!-- ops:end -->)", lambda m: m.group(1) + table + m.group(2),
                     text, flags=re.S)
    if n != 1:
        raise SystemExit(f"{path}: expected one <!-- ops:begin --> ... <!-- ops:end --> section, found {n}")
    path.write_text(new)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
