"""The layering of pagedkit (ARCHITECTURE.md): imports only go downward,

    interface (0) <- validators (1) <- kernels (2) <- runtime (3) <- exporters (4) / rewriters (4)

checked on the source: every `import` / `from ... import` of every module, function-level imports
included, relative imports resolved. Also: no cycle between subpackages, pagedkit.interface imports
nothing else of pagedkit, and importing pagedkit.interface / pagedkit.validators never imports torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedkit"
LAYERS = {"interface": 0, "validators": 1, "kernels": 2, "runtime": 3, "exporters": 4, "rewriters": 4}
# Upward imports that exist today and are to be removed (each names who imports what, and why it is not fixed
# here). The tests fail on any other upward import, and on an entry here that no longer exists (so that a fix
# also shrinks this list).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# Modules directly in pagedkit/ are outside the layers:
# - pagedkit/__init__.py is the lazy public facade (pagedkit.InferenceSession imports the runtime on first
#   use); an import of the bare package `pagedkit` from a layer is an import of that facade and is skipped;
# - any other top-level module (e.g. cli_errors.py, shared by the CLIs of several layers) is a leaf: it must
#   import nothing of pagedkit (test_top_level_modules_are_leaves), so it can join no upward edge or cycle.


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = _package_of(module, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    assert base, f"{module}: relative import beyond the top-level package"
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, source: str | None = None) -> list[tuple[str, int]]:
    """(imported pagedkit module, line) for every import in `module` (its file, or `source` as its text),
    at any depth of its source."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "pagedkit"]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path, node)
            if target.split(".")[0] != "pagedkit":
                continue
            for a in node.names:  # `from . import quant` imports the submodule pagedkit.kernels.quant
                sub = f"{target}.{a.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return out


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_subpackage_has_a_layer():
    for module, path in MODULES.items():
        parts = module.split(".")
        if len(parts) > 1 and (path.parent != ROOT or path.name == "__init__.py"):
            assert parts[1] in LAYERS, f"{module}: subpackage {parts[1]!r} has no layer in LAYERS"


def test_imports_only_go_downward():
    bad = []
    for module in MODULES:
        src = layer_of(module)
        if src is None:
            continue
        for target, line in imports_of(module):
            dst = layer_of(target)
            if dst is not None and dst > src and (module, target) not in KNOWN_UPWARD:
                bad.append(f"{MODULES[module].relative_to(ROOT.parent)}:{line}: {module} (layer {src}) imports "
                           f"{target} (layer {dst})")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_known_upward_imports_still_exist():
    """An entry of KNOWN_UPWARD that was fixed must leave the list (it would hide a regression)."""
    stale = [(m, t) for m, t in KNOWN_UPWARD if m not in MODULES or t not in {x for x, _ in imports_of(m)}]
    assert not stale, f"fixed, remove from KNOWN_UPWARD: {stale}"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_no_cycle_between_subpackages():
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for module in MODULES:
        a = _subpackage(module)
        for target, line in imports_of(module):
            b = _subpackage(target)
            if a and b and a != b and (module, target) not in KNOWN_UPWARD:
                edges.setdefault(a, set()).add(b)
                where.setdefault((a, b), f"{module}:{line} -> {target}")
    cycles = _cycles(edges)
    detail = [f"{c}: " + "; ".join(where[(x, y)] for x in c for y in c if (x, y) in where) for c in cycles]
    assert not cycles, "cycles between subpackages:\n" + "\n".join(detail)


def test_interface_imports_nothing_else_of_pagedkit():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("pagedkit.interface")
           for t, line in imports_of(m) if not t.startswith("pagedkit.interface")]
    assert not bad, "\n".join(bad)


def test_top_level_modules_are_leaves():
    top = [m for m, p in MODULES.items() if p.parent == ROOT and p.name != "__init__.py"]
    bad = [f"{m}:{line} imports {t}" for m in top for t, line in imports_of(m)]
    assert not bad, "\n".join(bad)


def test_import_resolution_sees_relative_and_function_level_imports():
    """The walker itself: a relative import, a `from . import submodule` and a function-level import."""
    got = {t for t, _ in imports_of("pagedkit.kernels.paged.cache")}
    assert "pagedkit.kernels.quant" in got  # from .. import quant
    got = {t for t, _ in imports_of("pagedkit.exporters.attention")}
    assert "pagedkit.validators.builders" in got  # inside paged_attention()


def test_an_upward_import_is_seen():
    """What the previous runtime/generate.py did (runtime -> exporters, the runtime <-> exporters cycle)."""
    src = "def f():\n    from ..exporters.config import read_pagedkit_section\n"
    (target, line), = imports_of("pagedkit.runtime.generate", src)
    assert (target, line, layer_of(target)) == ("pagedkit.exporters.config", 2, 4)


@pytest.mark.parametrize("packages", [["pagedkit.interface"], ["pagedkit.interface", "pagedkit.validators"]])
def test_ground_floor_does_not_import_torch(packages):
    code = ("import sys\n" + "".join(f"import {p}\n" for p in packages) +
            "import pagedkit.interface.genai_config, pagedkit.interface.dtypes, pagedkit.interface.names\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent)
    assert out.stdout.strip() == "[]", f"{packages} imported torch: {out.stdout.strip()[:200]}"
