"""benchmarks/: the README lists every script (the benchmarks at the top, probes and sweeps in probes/) and every
committed result; every result a doc or a comment cites exists; a probe still finds the shared helpers one level
up (its imports run as `python benchmarks/probes/X.py` runs them, without a GPU)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
RESULTS = BENCH / "results"
README = BENCH / "README.md"
CITED = re.compile(r"(?:benchmarks/)?results/([\w.-]+\.(?:json|png|log))\b")


def _scripts(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))


def _readme_table_column(heading: str, column: int) -> list[str]:
    body = README.read_text(encoding="utf-8").split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in body.splitlines() if line.startswith("| ")][1:]  # the header row off (the rule is "|---")
    return [re.split(r"(?<!\\)\|", r)[column].strip() for r in rows]


def test_readme_lists_every_script_and_nothing_else():
    top = {re.search(r"`([\w-]+(?:\.py)?)`", c).group(1) for c in _readme_table_column("Benchmarks", 1)}
    assert top - {"paged-bench"} == {p.name for p in _scripts(BENCH)}
    probes = {re.search(r"`probes/([\w]+\.py)`", c).group(1) for c in _readme_table_column("Probes", 1)}
    assert probes == {p.name for p in _scripts(BENCH / "probes")}
    for helper in ("_timing.py", "_provenance.py", "_ort_peer.py", "_attention_cases.py"):
        assert (BENCH / helper).is_file(), helper


def test_every_result_is_listed_and_every_listed_result_exists():
    cells = _readme_table_column("Benchmarks", 5) + _readme_table_column("Probes", 4)
    listed = {n for c in cells for n in re.findall(r"`([\w.-]+\.(?:json|png|log))`", c) if not n.startswith("_")}
    files = {p.name for p in RESULTS.iterdir()}
    assert listed <= files, f"listed but not committed: {sorted(listed - files)}"
    # a plot is listed beside its JSON (`x.json` + `.png` / `_roofline.png`)
    unlisted = {f for f in files - listed
                if not (f.endswith(".png") and re.sub(r"(_roofline)?\.png$", ".json", f) in listed)}
    assert not unlisted, f"committed but not in benchmarks/README.md: {sorted(unlisted)}"


def test_every_cited_result_exists():
    sources = [REPO / "README.md", README, *sorted((REPO / "docs").glob("*.md")),
               *sorted((REPO / "pagedkit").rglob("*.py")), *sorted(BENCH.rglob("*.py"))]
    missing = {(str(src.relative_to(REPO)), name) for src in sources
               for name in CITED.findall(src.read_text(encoding="utf-8")) if not (RESULTS / name).exists()}
    assert not missing, f"cited results that are not in benchmarks/results: {sorted(missing)}"


def _helper_imports(path: Path) -> set[str]:
    """The benchmarks/ modules a script imports by name (import X, from X import, importlib.import_module("X"))."""
    local = {p.stem for p in BENCH.glob("*.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return names & local


def test_probes_find_the_shared_helpers():
    pytest.importorskip("triton")
    probes = _scripts(BENCH / "probes")
    using = [p for p in probes if _helper_imports(p)]
    assert using, "no probe imports a shared helper: the check below checks nothing"
    for p in using:  # the script puts benchmarks/ on sys.path before its first helper import
        inserts = [line for line in p.read_text(encoding="utf-8").splitlines() if "sys.path.insert" in line]
        assert any("parents[1]" in line or "dirname(os.path.dirname(" in line for line in inserts), p.name
    # load each guarded probe as `python benchmarks/probes/X.py` would (sys.path[0] = probes/), main not run, each
    # on the sys.path and helper modules it would start with
    guarded = [p for p in using if 'if __name__ == "__main__"' in p.read_text(encoding="utf-8")]
    local = sorted(p.stem for p in BENCH.glob("*.py"))
    code = ("import importlib.util, sys\n"
            f"base, local = [{str(BENCH / 'probes')!r}, *sys.path], {local!r}\n"
            "for path in sys.argv[1:]:\n"
            "    sys.path[:] = base\n"
            "    for name in local:\n"
            "        sys.modules.pop(name, None)\n"
            "    spec = importlib.util.spec_from_file_location('probe_under_test', path)\n"
            "    sys.modules[spec.name] = mod = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(mod)\n")
    proc = subprocess.run([sys.executable, "-c", code, *map(str, guarded)], cwd=REPO / "tests", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
