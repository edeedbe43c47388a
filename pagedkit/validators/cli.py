"""`paged-validate MODEL.onnx|MODEL_DIR [--json]`: validate every attention node of a model.

Exit status: 0 clean (prints "OK: N attention nodes checked"), 1 issues (one line per issue on stdout,
a count on stderr), 2 the model is missing, unreadable or not ONNX, its folder names a file outside
itself, or its genai_config.json breaks the schema (genai_schema.py: each bad field and its expected value;
one line on stderr), 3 an internal error (one line on stderr; PAGEDKIT_DEBUG=1 re-raises).
--json prints {"issues": [issue dicts], "summary": {...}} instead (exit status unchanged).
A folder is read as its model.onnx (genai_config.json's decoder filename when given) plus
genai_config.json; external data is read only from inside the model's folder. A tensor-parallel folder
(`paged-export --tp N`: genai_config.json's pagedkit.tensor_parallel) is read as every rank's graph, each
checked with the folder's genai_config.json (AllReduce / AllGather included: validators/collectives.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ..cli_errors import cli_main
from .model import ModelReport, check_model


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="paged-validate",
        description="Check every com.microsoft PagedAttention / GroupQueryAttention node of an ONNX model "
                    "against the operator contract, plus the whole-model rules (caches written back, "
                    "attention_metadata a graph input, genai naming).")
    p.add_argument("model", help="path of a .onnx file, or a folder holding model.onnx (+ genai_config.json)")
    p.add_argument("--json", action="store_true", help="print a JSON document (issues + summary)")
    return p


@cli_main("paged-validate")  # errors: one stderr line; 2 bad input, 3 internal error (pagedkit/cli_errors.py)
def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    report = _check(args.model)
    ok = not report.issues
    if args.json:
        summary = {"model": report.path, "attention_nodes": report.attention_nodes,
                   "issues": len(report.issues), "ok": ok}
        print(json.dumps({"issues": [i.to_dict() for i in report.issues], "summary": summary}, indent=2))
    elif ok:
        print(f"OK: {report.attention_nodes} attention nodes checked")
    else:
        for issue in report.issues:
            print(str(issue).replace("\n", " "))
        print(f"{len(report.issues)} issue(s) in {report.path} ({report.attention_nodes} attention nodes checked)",
              file=sys.stderr)
    return 0 if ok else 1


def _check(model: str) -> ModelReport:
    """check_model of a file or folder; of every rank's graph for a tensor-parallel folder."""
    from pathlib import Path

    from .collectives import world_size
    from .model_loading import ModelLoadError, resolve_model_path

    folder = Path(model)
    if not folder.is_dir():
        return check_model(model)
    _, config, _ = resolve_model_path(folder)
    if world_size(config) is None:
        return check_model(model)
    from ..interface.genai_config import read_pagedkit_section
    from ..interface.paths import UnsafePathError, inside_folder

    ranks = read_pagedkit_section(config)["tensor_parallel"].get("ranks") or []
    issues, nodes = [], 0
    for r, name in enumerate(ranks):
        try:
            path = inside_folder(folder, name, f"pagedkit.tensor_parallel.ranks[{r}]")
        except UnsafePathError as exc:
            raise ModelLoadError(str(exc)) from None
        rep = check_model(path, genai_config=config)
        issues += rep.issues
        nodes += rep.attention_nodes
    return ModelReport(issues, nodes, f"{folder} ({len(ranks)} tensor-parallel ranks)")


if __name__ == "__main__":
    sys.exit(main())
