"""The mutants: cosmic-ray's core operators over a file's source (parso positions), filtered to realistic bugs,
plus the hand-written Triton list (tools/mutation/kernels.py) for kernel files. A mutant is data (path,
operator, occurrence, position); its mutated source is computed when it runs, on a copy of the repository.

Filters (what a random sample is drawn from):
- nothing inside a type annotation (`from __future__ import annotations`: never evaluated, so equivalent);
- binary operators replaced within their family only (arithmetic + - * / // % ** among themselves, bitwise
  & | ^ << >> among themselves): `a + b` -> `a << b` on floats is a TypeError, not a bug anyone writes;
- comparisons likewise (==, !=, <, <=, >, >= among themselves; `is` <-> `is not`; `in` <-> `not in`);
- no decorator removal (dropping @dataclass / @property crashes at import; dropping a cache is equivalent);
- nothing on a line marked `# pragma: no mutate`, nor under `if TYPE_CHECKING:`;
- no kernel launch tuning (the values of num_warps= / num_stages= / num_ctas= / maxnreg=): performance only,
  and ignored by Triton's interpreter.
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import functools
from dataclasses import asdict, dataclass
from pathlib import Path

ARITH = {"Add", "Sub", "Mul", "Div", "FloorDiv", "Mod", "Pow"}
BITS = {"BitAnd", "BitOr", "BitXor", "LShift", "RShift"}
ORDER = {"Eq", "NotEq", "Lt", "LtE", "Gt", "GtE"}
FAMILIES = (ARITH, BITS, ORDER, {"Is", "IsNot"}, {"In", "NotIn"})
LAUNCH_KWARGS = {"num_warps", "num_stages", "num_ctas", "maxnreg"}
DROPPED_OPERATORS = {"core/RemoveDecorator", "core/VariableReplacer", "core/VariableInserter"}


@dataclass(frozen=True)
class Mutant:
    path: str  # relative to the repository root
    operator: str  # "core/..." (cosmic-ray) or "kernel/..." (tools/mutation/kernels.py)
    occurrence: int  # cosmic-ray: the operator's occurrence in the file; kernel: index in the list
    line: int
    col: int
    function: str  # enclosing def (dotted), "" at module level
    # kernel mutants: the text splice (character offsets in the file's source)
    start: int = -1
    end: int = -1
    replacement: str = ""

    @property
    def id(self) -> str:
        return f"{self.path}::{self.operator}#{self.occurrence}"

    def as_dict(self) -> dict:
        return asdict(self) | {"id": self.id}


@functools.cache
def _operator(name: str):
    import cosmic_ray.plugins

    return cosmic_ray.plugins.get_operator(name)()


def operator_allowed(name: str) -> bool:
    if name in DROPPED_OPERATORS:
        return False
    for prefix in ("core/ReplaceBinaryOperator_", "core/ReplaceComparisonOperator_"):
        if name.startswith(prefix):
            a, b = name[len(prefix):].split("_")
            return any(a in fam and b in fam for fam in FAMILIES)
    return True


@functools.cache
def operator_names() -> tuple[str, ...]:
    import cosmic_ray.plugins

    return tuple(n for n in cosmic_ray.plugins.operator_names() if operator_allowed(n))


class _Spans:
    """Annotation spans, TYPE_CHECKING blocks, no-mutate lines and enclosing functions of one source, in
    parso's coordinates (1-based line, 0-based character column)."""

    def __init__(self, source: str):
        self.lines = source.splitlines()
        tree = ast.parse(source)
        self.annotations: list[tuple[tuple[int, int], tuple[int, int]]] = []  # and launch tuning values
        self.skip_lines: set[int] = {i + 1 for i, ln in enumerate(self.lines) if "pragma: no mutate" in ln}
        self.functions: list[tuple[int, int, str]] = []  # (first line, last line, dotted name)

        def visit(node, prefix):
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = f"{prefix}.{child.name}" if prefix else child.name
                    if not isinstance(child, ast.ClassDef):
                        self.functions.append((child.lineno, child.end_lineno, name))
                visit(child, name)

        visit(tree, "")
        for node in ast.walk(tree):
            ann = []
            if isinstance(node, ast.arg) and node.annotation is not None:
                ann.append(node.annotation)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
                ann.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                ann.append(node.annotation)
            elif isinstance(node, ast.keyword) and node.arg in LAUNCH_KWARGS:
                ann.append(node.value)
            elif (isinstance(node, ast.If) and isinstance(node.test, (ast.Name, ast.Attribute))
                  and ast.unparse(node.test).endswith("TYPE_CHECKING")):
                self.skip_lines.update(range(node.lineno, node.end_lineno + 1))
            for a in ann:
                self.annotations.append(((a.lineno, self._char(a.lineno, a.col_offset)),
                                         (a.end_lineno, self._char(a.end_lineno, a.end_col_offset))))

    def _char(self, line: int, byte_col: int) -> int:
        return len(self.lines[line - 1].encode("utf-8")[:byte_col].decode("utf-8", "replace"))

    def excluded(self, pos: tuple[int, int]) -> bool:
        return pos[0] in self.skip_lines or any(a <= pos < b for a, b in self.annotations)

    def function_at(self, line: int) -> str:
        best = ""
        for first, last, name in self.functions:  # innermost: the latest start that still encloses the line
            if first <= line <= last:
                best = name
        return best


def cosmic_ray_mutants(root: Path, path: str) -> list[Mutant]:
    from cosmic_ray.ast import ast_nodes, get_ast

    source = (root / path).read_text(encoding="utf-8")
    spans = _Spans(source)
    tree = get_ast(source)
    nodes = list(ast_nodes(tree))
    out = []
    for name in operator_names():
        op = _operator(name)
        positions = [(start, end) for node in nodes for start, end in op.mutation_positions(node)]
        for occurrence, (start, _end) in enumerate(positions):  # the order MutationVisitor counts in
            if spans.excluded(start):
                continue
            out.append(Mutant(path, name, occurrence, start[0], start[1], spans.function_at(start[0])))
    return out


def mutated_source(root: Path, m: Mutant, source: str | None = None) -> str | None:
    """The file's source with the mutant applied (None when cosmic-ray finds nothing to mutate)."""
    source = (root / m.path).read_text(encoding="utf-8") if source is None else source
    if m.operator.startswith("kernel/"):
        return source[:m.start] + m.replacement + source[m.end:]
    from cosmic_ray.mutating import mutate_code

    return mutate_code(source, _operator(m.operator), m.occurrence)


def describe(source: str, mutated: str | None) -> tuple[str, str]:
    """(original lines, mutated lines) where the two differ, stripped and joined."""
    if mutated is None:
        return "", "(no mutation)"
    a, b = source.splitlines(), mutated.splitlines()
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if tag != "equal":
            return " / ".join(s.strip() for s in a[i1:i2]), " / ".join(s.strip() for s in b[j1:j2])
    return "", "(identical)"


def all_mutants(root: Path, paths: list[str], kernel_list: bool = False) -> list[Mutant]:
    from . import kernels

    out = []
    for path in paths:
        out += cosmic_ray_mutants(root, path)
        if kernel_list:
            out += kernels.kernel_mutants(root, path)
    return sorted(out, key=lambda m: (m.path, m.line, m.col, m.operator, m.occurrence))


def expand(root: Path, globs: tuple[str, ...] | list[str], must_match: bool) -> list[str]:
    out: list[str] = []
    for g in globs:
        hits = sorted(str(p.relative_to(root)) for p in root.glob(g) if p.is_file())
        if must_match and not hits:
            raise SystemExit(f"mutation: {g!r} matches no file under {root}")
        out += [h for h in hits if h not in out]
    return out


def matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern)
