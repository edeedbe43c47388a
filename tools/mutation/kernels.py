"""The hand-written mutation list for Triton kernels: bugs that live in `@triton.jit` bodies and that
cosmic-ray's generic operators do not write. Each is located with Python's `ast` inside a function whose
decorator names `jit` and applied as a text splice on a copy of the file; the kernel tests then run it in
Triton's interpreter (TRITON_INTERPRET=1 on a machine without CUDA).

  kernel/where_swap     tl.where(c, a, b)           -> tl.where(c, b, a)
  kernel/drop_mask      tl.load(p, mask=m, other=x) -> tl.load(p)       (and tl.store(p, v, mask=m) -> no mask)
  kernel/other_value    tl.load(..., other=x)       -> other=0.0, or 1.0 where x is zero (the padding value)
  kernel/swap_fn        tl.maximum <-> tl.minimum, tl.max <-> tl.min, tl.exp <-> tl.exp2, tl.log <-> tl.log2,
                        tl.sqrt <-> tl.rsqrt
  kernel/drop_cast      x.to(tl.float32)            -> x               (accumulate in the storage type)
  kernel/axis           tl.sum/max/min/argmax(x, axis=0) <-> axis=1
  kernel/bound_off_by_one  a < b -> a < b - 1, a >= b -> a >= b + 1 ... in a mask / bound comparison (an
                        operand is an offset or index: the comparison is inside tl.load/tl.store/tl.where or
                        assigned to a name containing "mask")
"""

from __future__ import annotations

import ast
from pathlib import Path

from .mutants import Mutant, _Spans

SWAPS = {"maximum": "minimum", "minimum": "maximum", "max": "min", "min": "max", "exp": "exp2", "exp2": "exp",
         "log": "log2", "log2": "log", "sqrt": "rsqrt", "rsqrt": "sqrt"}
REDUCTIONS = {"sum", "max", "min", "argmax", "argmin", "reduce", "xor_sum"}


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _tl_call(node: ast.AST, names=None) -> str | None:
    """'load' for `tl.load(...)` (any alias ending in tl), else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
        if node.func.value.id in ("tl", "triton.language") and (names is None or node.func.attr in names):
            return node.func.attr
    return None


class _Offsets:
    def __init__(self, source: str):
        self.source = source
        self.starts = [0]
        for line in source.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))
        self.lines = source.splitlines()

    def at(self, line: int, byte_col: int) -> int:
        text = self.lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8", "replace")
        return self.starts[line - 1] + len(text)

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)

    def text(self, node: ast.AST) -> str:
        a, b = self.span(node)
        return self.source[a:b]


def kernel_mutants(root: Path, path: str) -> list[Mutant]:
    source = (root / path).read_text(encoding="utf-8")
    tree = ast.parse(source)
    off = _Offsets(source)
    spans = _Spans(source)
    edits: list[tuple[str, int, int, str, ast.AST]] = []  # (kind, start, end, replacement, node)

    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _is_jit(n)]:
        mask_names = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and "mask" in t.id.lower()
                                                    for t in node.targets):
                mask_names.add(id(node.value))
        bound_parents: set[int] = set()
        for node in ast.walk(fn):
            name = _tl_call(node)
            if name in ("load", "store", "where") or id(node) in mask_names:
                for sub in ast.walk(node):
                    bound_parents.add(id(sub))
        for node in ast.walk(fn):
            name = _tl_call(node)
            if name == "where" and len(node.args) == 3:
                (a0, a1), (b0, b1) = off.span(node.args[1]), off.span(node.args[2])
                new = off.text(node.args[2]) + source[a1:b0] + off.text(node.args[1])
                edits.append(("where_swap", a0, b1, new, node))
            if name in ("load", "store"):
                kws = [k for k in node.keywords if k.arg in ("mask", "other")]
                if any(k.arg == "mask" for k in kws):
                    keep = [off.text(a) for a in node.args] + [f"{k.arg}={off.text(k.value)}" if k.arg else
                                                               f"**{off.text(k.value)}" for k in node.keywords
                                                               if k.arg not in ("mask", "other")]
                    a, b = off.span(node)
                    edits.append(("drop_mask", a, b, f"{off.text(node.func)}({', '.join(keep)})", node))
                for k in node.keywords:
                    if k.arg == "other":
                        zero = isinstance(k.value, ast.Constant) and k.value.value == 0
                        a, b = off.span(k.value)
                        edits.append(("other_value", a, b, "1.0" if zero else "0.0", node))
            if name in SWAPS:
                a, b = off.span(node.func)
                edits.append(("swap_fn", a, b, f"{off.text(node.func.value)}.{SWAPS[name]}", node))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                    and node.args and "float32" in off.text(node.args[0])):
                a, b = off.span(node)
                edits.append(("drop_cast", a, b, off.text(node.func.value), node))
            if name in REDUCTIONS:
                for k in node.keywords:
                    if k.arg == "axis" and isinstance(k.value, ast.Constant) and k.value.value in (0, 1):
                        a, b = off.span(k.value)
                        edits.append(("axis", a, b, str(1 - k.value.value), node))
            if (isinstance(node, ast.Compare) and len(node.ops) == 1 and id(node) in bound_parents
                    and isinstance(node.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE))):
                right = node.comparators[0]
                delta = "- 1" if isinstance(node.ops[0], (ast.Lt, ast.LtE)) else "+ 1"
                a, b = off.span(right)
                edits.append(("bound_off_by_one", a, b, f"({off.text(right)}) {delta}", node))

    out, seen = [], set()
    for kind, a, b, new, node in sorted(edits, key=lambda e: (e[1], e[2], e[0])):
        if (a, b, new) in seen or source[a:b] == new:
            continue
        seen.add((a, b, new))
        line = source.count("\n", 0, a) + 1
        out.append(Mutant(path, f"kernel/{kind}", len(out), line, a - off.starts[line - 1],
                          spans.function_at(line), a, b, new))
    return out
