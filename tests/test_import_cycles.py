"""No import circle between the modules of pagedkit (issue 35): the module-level import graph, built from
the source as tests/test_layers.py's walker sees it (every `import` / `from ... import` at any depth:
function-level and TYPE_CHECKING imports included, relative imports resolved), has no cycle.

Imports spelled as strings count as ordinary imports too:
- `importlib.import_module("...", package)` / `__import__("...")` with a literal module name;
- a lazy alias: in a module that defines a module-level `__getattr__` (a lazy facade, a deprecation alias of a
  moved module), every string literal that names a pagedkit module, absolute ("pagedkit.x.y") or relative to
  the module's package (".y", "..x.y", or a bare "y" as pagedkit/exporters/__init__.py's `_LAZY` table writes
  it), is an import of that module.

A failure prints each circle as a path of edges, each with the file and line of its import.
"""

from __future__ import annotations

import ast
from collections import deque

from test_layers import MODULES, ROOT, _cycles, imports_of

_IMPORT_FUNCS = {"import_module", "__import__"}


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _resolve_name(module: str, name: str, *, bare: bool, package: str | None = None) -> str | None:
    """The pagedkit module a string names from `module` (absolute, or relative to `package`, by default the
    module's own package; a bare name relative to it only when `bare`), or None."""
    if name.split(".")[0] == "pagedkit":
        return name if name in MODULES else None
    if not name.replace(".", "").replace("_", "").isalnum():
        return None
    base = (package or _package(module)).split(".")
    if name.startswith("."):
        level = len(name) - len(name.lstrip("."))
        if level - 1 >= len(base):
            return None
        rest = name[level:]
        target = ".".join(base[: len(base) - (level - 1)] + ([rest] if rest else []))
    elif bare:
        target = ".".join(base + [name])
    else:
        return None
    return target if target in MODULES else None


def string_imports_of(module: str, source: str | None = None) -> list[tuple[str, int]]:
    """(imported pagedkit module, line) for the imports of `module` spelled as strings (module doc)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _IMPORT_FUNCS:
                pkg = node.args[1] if len(node.args) > 1 and name == "import_module" else None
                pkg = pkg.value if isinstance(pkg, ast.Constant) and isinstance(pkg.value, str) else None
                target = _resolve_name(module, node.args[0].value, bare=False, package=pkg)
                if target:
                    out.append((target, node.lineno))
    if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                target = _resolve_name(module, node.value, bare=True)
                if target and target != module:
                    out.append((target, node.lineno))
    return out


def import_graph(sources: dict[str, str] | None = None) -> tuple[dict[str, set[str]], dict[tuple[str, str], int]]:
    """(module -> the pagedkit modules it imports, (module, target) -> line of the first such import);
    `sources` replaces the text of some modules (the tests of the walker)."""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], int] = {}
    for module in MODULES:
        src = (sources or {}).get(module)
        for target, line in imports_of(module, src) + string_imports_of(module, src):
            if target == module or target not in MODULES:
                continue
            edges.setdefault(module, set()).add(target)
            where[(module, target)] = min(line, where.get((module, target), line))
    return edges, where


def shortest_cycle(edges: dict[str, set[str]], component: list[str], start: str | None = None) -> list[str]:
    """A shortest circle through `start` (default: the first module) of a strongly connected component:
    [start, ..., start], each step an edge."""
    inside, start = set(component), start or component[0]
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges.get(v, ())):
            if w not in inside:
                continue
            if w == start:  # v -> start closes it: start -> ... -> v from the parents
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start} in {component}")


def describe(edges: dict[str, set[str]], where: dict[tuple[str, str], int], component: list[str],
             start: str | None = None) -> str:
    """`a (file:line) -> b (file:line) -> ... -> a`: a shortest circle, each import with where it is written."""
    cycle = shortest_cycle(edges, component, start)
    steps = [f"{a} ({MODULES[a].relative_to(ROOT.parent)}:{where[(a, b)]})" for a, b in zip(cycle, cycle[1:])]
    text = " -> ".join(steps + [cycle[-1]])
    if len(component) > len(cycle) - 1:
        text += f" [one circle of a component of {len(component)} modules: {', '.join(component)}]"
    return text


def test_no_import_cycle_between_modules():
    edges, where = import_graph()
    circles = [describe(edges, where, c) for c in _cycles(edges)]
    assert not circles, "import circles (farm what both sides need into a lower module):\n" + "\n".join(circles)


# ---- the walker's teeth -------------------------------------------------------------------------------------

def test_string_imports_of_a_lazy_table_and_import_module():
    """pagedkit/exporters/__init__.py's lazy `_LAZY` table ("export", "families.base", "..interface") and an
    `importlib.import_module` with a literal name are seen; a string that names no module is not."""
    got = {t for t, _ in string_imports_of("pagedkit.exporters")}
    assert {"pagedkit.exporters.export", "pagedkit.exporters.families.base", "pagedkit.interface",
            "pagedkit.exporters.registry"} <= got
    src = ("import importlib\n"
           "def f():\n    return importlib.import_module('.common', 'pagedkit.kernels.triton')\n"
           "def g():\n    return importlib.import_module('pagedkit.kernels.variant')\n"
           "X = 'quant'  # no __getattr__ here: a bare string is not an import\n")
    assert sorted(string_imports_of("pagedkit.kernels.dispatch", src)) == [("pagedkit.kernels.triton.common", 3),
                                                                           ("pagedkit.kernels.variant", 5)]


def test_a_deprecation_alias_counts_as_an_import():
    """A moved module's lazy alias (`__getattr__` importing the new place) is an ordinary import: one that
    points back at its importer closes a circle, and the failure names both imports with their lines."""
    alias = ("import importlib\n_MOVED = {'session': 'pagedkit.runtime.session'}\n"
             "def __getattr__(name):\n    return importlib.import_module(_MOVED[name])\n")
    got = string_imports_of("pagedkit.runtime.fuse", alias)
    assert ("pagedkit.runtime.session", 2) in got
    # fuse (the alias) -> session, and session imports graph, which imports fuse (function level)
    edges, where = import_graph({"pagedkit.runtime.fuse": alias})
    circles = [c for c in _cycles(edges) if "pagedkit.runtime.fuse" in c]
    assert circles, "the alias' circle was not seen"
    text = describe(edges, where, circles[0], "pagedkit.runtime.fuse")
    assert text.startswith("pagedkit.runtime.fuse (pagedkit/runtime/fuse.py:2) -> pagedkit.runtime.session ("), text
    assert "-> pagedkit.runtime.graph (pagedkit/runtime/graph.py:" in text and "-> pagedkit.runtime.fuse" in text, text


def test_a_function_level_import_closes_a_circle():
    """What runtime/graph.py <-> runtime/fuse.py was before issue 35: fuse imported graph's Graph / Step, graph
    imported fuse inside compile_model."""
    real = MODULES["pagedkit.runtime.fuse"].read_text(encoding="utf-8")
    src = real.replace("from .steps import Graph, Step", "from .graph import Graph, Step")
    assert src != real, "runtime/fuse.py no longer imports Graph, Step from .steps: update this test"
    edges, where = import_graph({"pagedkit.runtime.fuse": src})
    assert ["pagedkit.runtime.fuse", "pagedkit.runtime.graph"] in _cycles(edges)
    text = describe(edges, where, ["pagedkit.runtime.fuse", "pagedkit.runtime.graph"])
    assert text.startswith("pagedkit.runtime.fuse (pagedkit/runtime/fuse.py:") and " -> pagedkit.runtime.graph (" \
        in text and text.endswith("-> pagedkit.runtime.fuse"), text


def test_shortest_cycle_is_a_path_of_edges():
    edges = {"a": {"b", "x"}, "b": {"c"}, "c": {"a"}, "x": {"b"}}
    cycle = shortest_cycle(edges, ["a", "b", "c", "x"])
    assert cycle == ["a", "b", "c", "a"]
    assert all(b in edges[a] for a, b in zip(cycle, cycle[1:]))
    assert shortest_cycle({"a": {"a"}}, ["a"]) == ["a", "a"]
