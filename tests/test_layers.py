"""The layering of pagedkit (ARCHITECTURE.md, README's Layers): imports only go downward,

    interface (0) <- validators (1) <- kernels (2) <- runtime (3) <- engine (4) / exporters (4) / rewriters (4)
                                                                  <- apps (5: serve/, bench/, run/)

checked on the source: every `import` / `from ... import` of every module, function-level imports
included, relative imports resolved. Also: no cycle between subpackages, pagedkit.interface imports
nothing else of pagedkit but pagedkit.settings (the environment variables, beneath every layer, importing
nothing of pagedkit), and importing pagedkit.interface / pagedkit.validators / pagedkit.settings never imports
torch.
The one exception, listed below (ALIASES): the deprecated old paths of what moved out of runtime/, which
pagedkit/runtime/moved.py resolves lazily; they are checked to work, to warn once and to stay lazy.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedkit"
LAYERS = {"interface": 0, "validators": 1, "kernels": 2, "runtime": 3, "engine": 4, "exporters": 4, "rewriters": 4,
          "apps": 5}
# Upward imports that exist today and are to be removed (each names who imports what, and why it is not fixed
# here). The tests fail on any other upward import, and on an entry here that no longer exists (so that a fix
# also shrinks this list).
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
# The only upward references allowed: the deprecated aliases of the paths that moved out of runtime/ (issue 35),
# old name -> new name, a table of strings in ALIAS_MODULE (its `MOVED`) resolved by an import hook on the first
# import of an old name, never at `import pagedkit.runtime`. The walker reads the table as references of
# ALIAS_MODULE to the new modules; the tests fail on any other upward reference and on a table that differs
# from this list.
ALIAS_MODULE = "pagedkit.runtime.moved"
ALIASES = {
    "pagedkit.runtime.engine": "pagedkit.engine",
    "pagedkit.runtime.serve": "pagedkit.apps.serve",
    "pagedkit.runtime.bench": "pagedkit.apps.bench",
    "pagedkit.runtime.cli": "pagedkit.apps.run.cli",
}
# Modules directly in pagedkit/ are outside the layers:
# - pagedkit/__init__.py is the lazy public facade (pagedkit.InferenceSession imports the runtime on first
#   use); an import of the bare package `pagedkit` from a layer is an import of that facade and is skipped;
# - any other top-level module (e.g. cli_errors.py, shared by the CLIs of several layers) is a leaf: it must
#   import nothing of pagedkit but SETTINGS (test_top_level_modules_are_leaves), so it can join no upward edge or
#   cycle;
# - SETTINGS (pagedkit/settings.py: every environment variable, declared once) lies beneath every layer, the
#   interface included: it imports nothing of pagedkit and no torch, and every module may import it.
SETTINGS = "pagedkit.settings"


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


def alias_table(source: str | None = None) -> dict[str, tuple[str, int]]:
    """ALIAS_MODULE's `MOVED = {old: new, ...}` as {old: (new, line)} (its file, or `source` as its text)."""
    path = MODULES[ALIAS_MODULE]
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, str(path))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(
            node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "MOVED" and isinstance(node.value, ast.Dict):
            return {ast.literal_eval(k): (ast.literal_eval(v), k.lineno) for k, v in zip(node.value.keys,
                                                                                      node.value.values)}
    raise AssertionError(f"{path}: no MOVED = {{old: new}} table")


def references_of(module: str) -> list[tuple[str, int]]:
    """imports_of(module), plus the alias table's new modules for ALIAS_MODULE."""
    refs = imports_of(module)
    if module == ALIAS_MODULE:
        refs += [(new, line) for new, line in alias_table().values()]
    return refs


def _allowed(module: str, target: str) -> bool:
    return (module, target) in KNOWN_UPWARD or (module == ALIAS_MODULE and target in ALIASES.values())


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
        for target, line in references_of(module):
            dst = layer_of(target)
            if dst is not None and dst > src and not _allowed(module, target):
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
        for target, line in references_of(module):
            b = _subpackage(target)
            if a and b and a != b and not _allowed(module, target):
                edges.setdefault(a, set()).add(b)
                where.setdefault((a, b), f"{module}:{line} -> {target}")
    cycles = _cycles(edges)
    detail = [f"{c}: " + "; ".join(where[(x, y)] for x in c for y in c if (x, y) in where) for c in cycles]
    assert not cycles, "cycles between subpackages:\n" + "\n".join(detail)


def test_interface_imports_nothing_else_of_pagedkit():
    bad = [f"{m}:{line} imports {t}" for m in MODULES if m.startswith("pagedkit.interface")
           for t, line in imports_of(m) if not t.startswith("pagedkit.interface") and t != SETTINGS]
    assert not bad, "\n".join(bad)


def leaf_problems(module: str, source: str | None = None) -> list[str]:
    """What a top-level module imports of pagedkit beyond SETTINGS (SETTINGS itself: anything of pagedkit)."""
    return [f"{module}:{line} imports {t}" for t, line in imports_of(module, source)
            if module == SETTINGS or t != SETTINGS]


def test_top_level_modules_are_leaves():
    top = [m for m, p in MODULES.items() if p.parent == ROOT and p.name != "__init__.py"]
    assert SETTINGS in top and "pagedkit.cli_errors" in top
    bad = [problem for m in top for problem in leaf_problems(m)]
    assert not bad, "\n".join(bad)


def test_a_leaf_importing_more_than_the_settings_is_seen():
    """The exception is the settings module alone, and the settings module itself may import nothing."""
    assert leaf_problems("pagedkit.cli_errors", "from . import settings\n") == []
    assert leaf_problems("pagedkit.cli_errors", "from . import settings\nfrom .interface import names\n") == [
        "pagedkit.cli_errors:2 imports pagedkit.interface.names"]
    assert leaf_problems(SETTINGS, "def f():\n    from . import cli_errors\n") == [
        "pagedkit.settings:2 imports pagedkit.cli_errors"]


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


@pytest.mark.parametrize("packages", [["pagedkit.interface"], ["pagedkit.interface", "pagedkit.validators"],
                                      [SETTINGS]])
def test_ground_floor_does_not_import_torch(packages):
    code = ("import sys\n" + "".join(f"import {p}\n" for p in packages) +
            "import pagedkit.interface.genai_config, pagedkit.interface.dtypes, pagedkit.interface.names\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent)
    assert out.stdout.strip() == "[]", f"{packages} imported torch: {out.stdout.strip()[:200]}"


# ---- the layout of issue 35: engine/ above runtime/, the apps above the engine ------------------------------

def test_every_layer_is_a_folder():
    missing = [name for name in LAYERS if not (ROOT / name / "__init__.py").is_file()]
    assert not missing, f"LAYERS names packages that do not exist: {missing}"


def test_walker_covers_the_engine_and_the_apps():
    assert layer_of("pagedkit.engine.model") == 4 and layer_of("pagedkit.apps.serve.app") == 5
    got = {t for t, _ in imports_of("pagedkit.engine.model")}
    assert "pagedkit.runtime.session" in got  # from ..runtime.session import ...
    got = {t for t, _ in imports_of("pagedkit.apps.bench.cli")}
    assert {"pagedkit.engine", "pagedkit.runtime.generate"} <= got  # function-level, three dots up
    assert any(m.startswith("pagedkit.apps.run.") for m in MODULES) and "pagedkit.apps.serve.cli" in MODULES


@pytest.mark.parametrize("module, src, want", [
    ("pagedkit.runtime.generate", "from ..engine import Engine\n", ("pagedkit.engine", 1, 4)),
    ("pagedkit.engine.model", "def f():\n    from ..apps.serve import create_app\n", ("pagedkit.apps.serve", 2, 5)),
])
def test_an_upward_import_of_the_new_layers_is_seen(module, src, want):
    (target, line), = imports_of(module, src)
    assert (target, line, layer_of(target)) == want
    assert not _allowed(module, target)


def test_the_aliases_are_the_only_upward_references():
    """ALIASES is exactly the alias module's table: each old name is gone from the tree (only the alias
    resolves it), each new name exists and lies above the runtime; an entry added to the table and not here is
    an upward reference the tests refuse."""
    table = alias_table()
    assert {old: new for old, (new, _) in table.items()} == ALIASES
    for old, new in ALIASES.items():
        assert old not in MODULES, f"{old} is still a module of its own: the alias would not be the only path"
        assert new in MODULES and layer_of(new) > layer_of(ALIAS_MODULE), (old, new)
    src = MODULES[ALIAS_MODULE].read_text(encoding="utf-8").replace(
        '"pagedkit.runtime.cli": "pagedkit.apps.run.cli",',
        '"pagedkit.runtime.cli": "pagedkit.apps.run.cli",\n    "pagedkit.runtime.x": "pagedkit.apps.x",')
    assert alias_table(src)["pagedkit.runtime.x"][0] == "pagedkit.apps.x"
    assert not _allowed(ALIAS_MODULE, "pagedkit.apps.x")


_ALIAS_SCRIPT = r"""
import importlib, json, os, sys, tempfile, warnings
import pagedkit.runtime
report = {"eager": sorted(m for m in sys.modules if m.split(".")[:2] in (["pagedkit", "engine"], ["pagedkit", "apps"]))}
# a leftover folder of an old package (what a checkout keeps after the move: __pycache__/) must not shadow an alias
stale = tempfile.mkdtemp()
for name in ("engine", "serve", "bench"):
    os.makedirs(os.path.join(stale, name, "__pycache__"))
pagedkit.runtime.__path__.append(stale)
for old, (new, subs) in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        same = [importlib.import_module(old) is importlib.import_module(new)]
        same += [importlib.import_module(old + s) is importlib.import_module(new + s) for s in subs]
        parent, _, leaf = old.rpartition(".")
        same.append(getattr(importlib.import_module(parent), leaf) is importlib.import_module(new))
        exec(f"from {parent} import {leaf} as again\nsame.append(again is importlib.import_module(new))")
        same += [importlib.import_module(new + s).__spec__.name == new + s for s in ["", *subs]]  # its own spec
    report[old] = {"same": same, "warnings": [[str(x.message), x.category.__name__, x.filename] for x in w]}
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def alias_report():
    """One fresh interpreter imports every old name (each package's submodules included) next to its new one."""
    import json

    aliases = {old: [new, sorted(m[len(new):] for m in MODULES if m.startswith(new + "."))]
               for old, new in ALIASES.items()}
    out = subprocess.run([sys.executable, "-c", _ALIAS_SCRIPT, json.dumps(aliases)], capture_output=True,
                         text=True, cwd=ROOT.parent, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_runtime_imports_nothing_above_it(alias_report):
    assert alias_report["eager"] == [], f"import pagedkit.runtime imported {alias_report['eager']}"


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_path_is_the_new_module_and_warns_once(alias_report, old):
    got = alias_report[old]
    assert got["same"] and all(got["same"]), f"{old}: not the very modules of {ALIASES[old]}: {got['same']}"
    assert len(got["warnings"]) == 1, got["warnings"]  # once, however many submodules and imports followed
    (message, category, filename), = got["warnings"]
    assert category == "DeprecationWarning" and ALIASES[old] in message and old in message, message
    assert filename == "<string>", f"the warning points at {filename}, not at the importing line"


@pytest.mark.parametrize("old, prog", [("pagedkit.runtime.cli", "paged-run"),
                                       ("pagedkit.runtime.serve.cli", "paged-serve")])
def test_python_dash_m_on_an_old_path(old, prog):
    """`python -m OLD` (what docs and scripts used) runs the new module as __main__, with one warning."""
    out = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", old, "--help"],
                         capture_output=True, text=True, cwd=ROOT.parent, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith(f"usage: {prog}"), (out.stdout[:300], out.stderr[-2000:])
    root = next(o for o in ALIASES if old == o or old.startswith(o + "."))
    warned = [line for line in out.stderr.splitlines() if "DeprecationWarning" in line]
    assert len(warned) == 1 and f"moved to {ALIASES[root]}" in warned[0], out.stderr[-2000:]
