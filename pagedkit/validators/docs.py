"""Generate docs/ops/PagedAttention.md and docs/ops/GroupQueryAttention.md from the contract data.

    python -m pagedkit.validators.docs            # (re)write docs/ops/*.md
    python -m pagedkit.validators.docs --check    # exit 1 and name the stale files

Each page follows the kernel-card layout (../shared/seeds/webgpu-gqa-kernel-card.txt): header,
description, Inputs / Outputs / Attributes / Type constraints tables, the in-place caches and host-memory
inputs (`Param.aliases`, `Param.host`), the cache formats (`CACHE_FORMATS`) and the block-size rule
(`BLOCK_SIZE_RULE`), the semantics of each feature (`contract.semantics`), then the validation rules
(`RULE_DOCS` of rules/paged.py / rules/gqa.py and the whole-model rules of model.py). Nothing here restates
contract data: it is all read from contract.py.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .contract import (
    BLOCK_SIZE_RULE, CACHE_FORMATS, CONTRACTS, MIN_BLOCK_SIZE, Attr, CacheFormat, OpContract, Param, block_size_error,
)
from .model import PAGED_ONLY_RULES
from .model import RULE_DOCS as MODEL_RULE_DOCS

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs" / "ops"
COMMAND = "python -m pagedkit.validators.docs"
_RULE_MODULES = {"PagedAttention": "rules.paged", "GroupQueryAttention": "rules.gqa"}
ORT_VERSION = "1.32.0"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _code(text: object) -> str:
    return f"`{text}`"


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _rank(p: Param) -> str:
    if p.rank is None:
        return "any"
    ranks = p.rank if isinstance(p.rank, tuple) else (p.rank,)
    return " or ".join(_code(r) for r in ranks)


def _source(shipped: bool) -> str:
    return f"onnxruntime {ORT_VERSION}" if shipped else "pagedkit extension"


def _param_rows(params: tuple[Param, ...]) -> list[list[object]]:
    return [[p.index, _code(p.name), _code(p.type_param), _rank(p), _code(p.shape), p.description,
             "optional" if p.optional else "required", _source(p.shipped)] for p in params]


def _default(a: Attr) -> str:
    if a.required:
        return "required"
    if a.default is None:
        return "— (absent)"
    return _code(f'"{a.default}"' if a.type == "string" else a.default)


def _allowed(a: Attr) -> str:
    if not a.allowed:
        return "—"
    return ", ".join(_code(f'"{v}"' if a.type == "string" else v) for v in a.allowed)


def _type_name(t: str) -> str:
    return t[len("tensor("):-1] if t.startswith("tensor(") else t


def _width(fmt: CacheFormat) -> str:
    """The stored last dimension of a cache in this format, as a formula of head_size."""
    n = fmt.per_element
    return "head_size" if n == 1 else f"(head_size + {n - 1}) / {n}"


def _facts(c: OpContract) -> list[str]:
    """In-place caches (Param.aliases), host-memory inputs (Param.host) and, for an op with
    k/v_cache_dtype and block caches, the cache formats (CACHE_FORMATS) and the block-size rule."""
    lines = ["## In-place caches and host inputs", "",
             "Each cache output below aliases a cache input (`Param.aliases`): bound to the same buffer, the "
             "node updates that cache in place, and the caller feeds the updated output back as that input on "
             "the next step.", ""]
    lines += _table(["Output", "Aliases input", "Cache kind", "Source"],
                    [[_code(p.name), _code(p.aliases), c.input(p.aliases).cache_kind or "—", _source(p.shipped)]
                     for p in c.outputs if p.aliases])
    host = [c.input(n) for n in c.host_inputs]
    if host:
        lines += ["Host-memory inputs (onnxruntime keeps them in CPU memory, `OrtMemTypeCPUInput`; a kernel reads "
                  "them on the host without a device copy): " + ", ".join(
                      f"{_code(p.name)} (input {p.index})" for p in host) + ".", ""]
    if any(a.name == "k_cache_dtype" for a in c.attributes):
        lines += ["## Cache formats", "",
                  "What `k_cache_dtype` / `v_cache_dtype` name, the element type of the cache tensor that holds "
                  "them, and its last dimension (the stored width) for head_size channels. Quantized formats "
                  "hold codes that need a scale (k/v_quant_type); qmax is the largest code magnitude "
                  "(PER_TOKEN scale = amax / qmax).", ""]
        lines += _table(["Format", "Cache tensor type", "Quantized", "Channels per element", "Stored width",
                         "qmax"],
                        [[_code(f.name), _code(_type_name(f.storage)), "yes" if f.quantized else "no",
                          f.per_element, _code(_width(f)), "—" if f.qmax is None else f"{f.qmax:g}"]
                         for f in CACHE_FORMATS.values()])
    if any(p.name == "block_table" for p in c.inputs):
        lines += ["## Block size", "",
                  f"`block_size` (cache dimension 1) follows one rule, as onnxruntime requires: "
                  f"*{BLOCK_SIZE_RULE}* ({MIN_BLOCK_SIZE}, {2 * MIN_BLOCK_SIZE}, {4 * MIN_BLOCK_SIZE}, ...). "
                  "The validator (`PA-block-size`, `MODEL-block-size`), `paged-export --block-size`, the Python "
                  "`export()`, `paged-run --block-size` and the KV block manager all refuse any other value with "
                  f"the same text, e.g. `{block_size_error(MIN_BLOCK_SIZE // 2)}`.", ""]
    return lines


def rule_docs(contract: OpContract) -> dict[str, str]:
    """Node rules (RULE_DOCS of the op's rules module, when it has one) then the whole-model rules."""
    module = importlib.import_module(f"{__package__}.{_RULE_MODULES[contract.name]}")
    docs = dict(getattr(module, "RULE_DOCS", {}) or {})
    for rule, text in MODEL_RULE_DOCS.items():
        if contract.name == "PagedAttention" or rule not in PAGED_ONLY_RULES:
            docs[rule] = text
    return docs


def render(contract: OpContract) -> str:
    c = contract
    lines = [
        f"# {c.domain}.{c.name}", "",
        f"`{c.domain}`  ·  ONNX Runtime contrib operator  ·  contrib since_version {c.since_version}", "",
        f"<!-- Generated by `{COMMAND}` from pagedkit/validators/contract.py and the rule tables. "
        "Do not edit by hand. -->", "",
        "## Description", "", c.summary, "",
        f"Inputs, outputs and attributes marked *pagedkit extension* are not in onnxruntime {ORT_VERSION}'s "
        "schema; indices never compact (unused optional positions are empty names).", "",
        "## Inputs", "",
        *_table(["Index", "Name", "Type", "Rank", "Shape", "Description", "Presence", "Source"],
                _param_rows(c.inputs)),
        "## Outputs", "",
        *_table(["Index", "Name", "Type", "Rank", "Shape", "Description", "Presence", "Source"],
                _param_rows(c.outputs)),
        "## Attributes", "",
        *_table(["Attribute", "Type", "Default", "Allowed values", "Description", "Source"],
                [[_code(a.name), a.type, _default(a), _allowed(a), a.description, _source(a.shipped)]
                 for a in c.attributes]),
        "## Type constraints", "",
        *_table(["Variable", "Allowed types", "Description"],
                [[_code(k), ", ".join(_code(_type_name(t)) for t in v), c.type_constraint_docs.get(k, "")]
                 for k, v in c.type_constraints.items()]),
        *_facts(c),
        "## Semantics", "",
    ]
    for heading, text in c.semantics:
        lines += [f"### {heading}", "", text, ""]
    docs = rule_docs(c)
    lines += ["## Validation rules", "",
              "Rule ids as `paged-validate` and `validate_node` / `check_inputs` / `validate_model` report them "
              "(see [docs/validate.md](../validate.md)). `MODEL-` rules apply to whole models.", ""]
    lines += _table(["Rule", "Description"], [[_code(r), t] for r, t in docs.items()]) if docs else \
        ["(no rules registered)", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def targets(out_dir: Path = DOCS_DIR) -> dict[Path, str]:
    return {Path(out_dir) / f"{c.name}.md": render(c) for c in CONTRACTS.values()}


def write_docs(out_dir: Path = DOCS_DIR) -> list[Path]:
    written = []
    for path, text in targets(out_dir).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale_docs(out_dir: Path = DOCS_DIR) -> list[Path]:
    """Docs whose committed text differs from what the contract data generates now."""
    return [p for p, text in targets(out_dir).items()
            if not p.is_file() or p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DOCS_DIR, help=f"output folder (default {DOCS_DIR})")
    ap.add_argument("--check", action="store_true", help="only report stale docs (exit 1 when any)")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_docs(args.out)
        for p in stale:
            print(f"stale: {p} (regenerate with `{COMMAND}`)")
        return 1 if stale else 0
    for p in write_docs(args.out):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
