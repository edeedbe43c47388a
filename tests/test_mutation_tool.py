"""tools/mutation (python -m tools.mutation): the component table names files that exist, the mutant filters
(annotations, launch tuning, operator families), the hand-written Triton list (only inside @triton.jit
bodies, every mutant still parses), and the runner: on a throwaway git repository it reports a killed, a
surviving and a hanging mutant as such, and leaves both the live tree and its copies unmutated. The parts
that need cosmic-ray (pip install -e ".[mutation]") run in `python -m tools.mutation` itself."""

from __future__ import annotations

import ast
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.mutation import kernels  # noqa: E402
from tools.mutation.__main__ import tests_for as selection_for  # noqa: E402
from tools.mutation.components import COMPONENTS  # noqa: E402
from tools.mutation.mutants import _Spans, expand, matches, mutated_source, operator_allowed  # noqa: E402

ISSUE_COMPONENTS = {"engine", "serve", "kv", "parity", "delegate", "rewriters", "exporters", "kernels"}


def test_every_component_of_the_issue_is_in_the_table():
    assert set(COMPONENTS) == ISSUE_COMPONENTS


@pytest.mark.parametrize("name", sorted(ISSUE_COMPONENTS))
def test_component_files_exist(name):
    """Source globs match; a test path without wildcards names an existing file (a renamed test file must be
    renamed here too); each per-source selection matches a source and a test."""
    comp = COMPONENTS[name]
    sources = expand(ROOT, comp.sources, must_match=True)
    assert sources

    def paths(selection):  # the file entries, without pytest options ("-k", "expr")
        out, it = [], iter(selection)
        for entry in it:
            if entry.startswith("-"):
                if entry in ("-k", "-m"):
                    next(it)
            else:
                out.append(entry)
        return out

    for pattern in paths(comp.tests):
        if not any(c in pattern for c in "*?["):
            assert (ROOT / pattern).is_file(), f"{name}: {pattern} does not exist"
    assert expand(ROOT, paths(comp.tests), must_match=False)
    for pattern, tests in comp.tests_by_source:
        assert any(matches(s, pattern) for s in sources), f"{name}: {pattern} matches no source"
        for t in paths(tests):
            if "{stem}" not in t and not any(c in t for c in "*?["):
                assert (ROOT / t).is_file(), f"{name}: {t} does not exist"
    for s in sources:  # every source resolves to a selection with at least one test file
        assert any(t.startswith("tests/") for t in selection_for(ROOT, comp, s)), s
    for pattern, why in comp.exclude:
        assert why and any(matches(s, pattern.split("::")[0]) for s in expand(ROOT, comp.sources, True))
    assert 0 < comp.timeout <= comp.budget


def test_operator_families():
    assert operator_allowed("core/ReplaceBinaryOperator_Add_Sub")
    assert operator_allowed("core/ReplaceBinaryOperator_LShift_RShift")
    assert not operator_allowed("core/ReplaceBinaryOperator_Add_LShift")
    assert not operator_allowed("core/ReplaceBinaryOperator_BitOr_Add")  # `str | Path`, or flags
    assert operator_allowed("core/ReplaceComparisonOperator_Lt_LtE")
    assert operator_allowed("core/ReplaceComparisonOperator_Is_IsNot")
    assert not operator_allowed("core/ReplaceComparisonOperator_Eq_Is")
    assert not operator_allowed("core/RemoveDecorator")
    assert operator_allowed("core/NumberReplacer") and operator_allowed("core/ZeroIterationForLoop")


def test_spans_exclude_annotations_type_checking_pragmas_and_launch_tuning():
    src = textwrap.dedent('''\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            x = 1 + 2
        def f(a: int | None = 3, *, b: "é" = 1) -> dict[str, int | float]:
            y: list[int | str] = [a + 1]
            k(grid, num_warps=4 + 0, z=5)  # é
            return y  # pragma: no mutate
        ''')
    s = _Spans(src)
    assert s.excluded((3, 8))  # under TYPE_CHECKING
    assert s.excluded((4, 13)) and not s.excluded((4, 24))  # `int | None` excluded, the default 3 is not
    assert s.excluded((4, 48))  # the return annotation
    assert s.excluded((5, 17)) and not s.excluded((5, 27))  # the AnnAssign's annotation, not its value
    assert s.excluded((6, 22)) and s.excluded((6, 26)) and not s.excluded((6, 31))  # num_warps=4 + 0, not z=5
    assert s.excluded((7, 4))
    assert s.function_at(5) == "f" and s.function_at(1) == ""


KERNEL_SRC = textwrap.dedent('''\
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(x, axis=0)
        y = tl.where(mask, tl.exp(x - m), 0.0)
        tl.store(o_ptr + offs, y / tl.sum(y, axis=0), mask=offs < n)

    def host(x):
        return tl.load(x, mask=x < 3)  # not a kernel: never mutated by the list
    ''')


def test_kernel_list_inside_jit_bodies_only(tmp_path):
    (tmp_path / "k.py").write_text(KERNEL_SRC)
    ms = kernels.kernel_mutants(tmp_path, "k.py")
    got = {(m.operator, m.line) for m in ms}
    assert all(m.function == "k" for m in ms)
    assert {("kernel/drop_mask", 8), ("kernel/other_value", 8), ("kernel/drop_cast", 8), ("kernel/swap_fn", 9),
            ("kernel/axis", 9), ("kernel/where_swap", 10), ("kernel/swap_fn", 10), ("kernel/drop_mask", 11),
            ("kernel/bound_off_by_one", 7), ("kernel/bound_off_by_one", 11)} <= got, got
    texts = {m.operator + str(m.line): mutated_source(tmp_path, m) for m in ms}
    for t in texts.values():
        ast.parse(t)
    assert "tl.where(mask, 0.0, tl.exp(x - m))" in texts["kernel/where_swap10"]
    assert "x = tl.load(x_ptr + offs).to(tl.float32)" in texts["kernel/drop_mask8"]
    assert "mask = offs < (n) - 1" in texts["kernel/bound_off_by_one7"]
    assert 'other=0.0' in texts["kernel/other_value8"]


def test_kernel_list_on_the_real_kernels():
    files = expand(ROOT, COMPONENTS["kernels"].sources, must_match=True)
    found = [m for f in files for m in kernels.kernel_mutants(ROOT, f)]
    assert len(found) > 200 and {m.operator for m in found} >= {
        "kernel/where_swap", "kernel/drop_mask", "kernel/other_value", "kernel/swap_fn", "kernel/drop_cast",
        "kernel/axis", "kernel/bound_off_by_one"}
    sources = {f: (ROOT / f).read_text(encoding="utf-8") for f in files}
    for m in random.Random(0).sample(found, 60):  # each a valid module still
        ast.parse(mutated_source(ROOT, m, sources[m.path]))


RUNNER = textwrap.dedent('''\
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from tools.mutation.mutants import Mutant, mutated_source
    from tools.mutation.runner import Job, Pool
    root = Path(sys.argv[1])
    src = (root / "lib.py").read_text()
    def splice(old, new, k, timeout=120):
        a = src.index(old)
        m = Mutant("lib.py", "kernel/test", k, 1, 0, "", a, a + len(old), new)
        return Job(str(k), "lib.py", mutated_source(root, m, src), ["test_lib.py"], timeout)
    pool = Pool(root, 2, modules=())
    jobs = [splice("a + b", "a - b", 0), splice("a + b", "b + a", 1),
            splice("return a + b", "while True: pass", 2, timeout=4), splice("a + b", "a + b + (1 if b > 5 else 0)", 3)]
    base = pool.run([Job("baseline", "", None, ["test_lib.py"], 60)])
    res = pool.run(jobs)
    after = [(s / "lib.py").read_text() == src for s in pool.slots]
    pool.close()
    print(json.dumps({"baseline": base["baseline"].status,
                      **{k: [o.status, o.killed_by] for k, o in res.items()}, "restored": after}))
    ''')


def test_runner_kills_survives_times_out_and_restores(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "lib.py").write_text("def add(a, b):\n    return a + b\n")
    (repo / "test_lib.py").write_text("from lib import add\n\ndef test_add():\n    assert add(2, 3) == 5\n")
    (repo / "pytest.ini").write_text("[pytest]\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    (tmp_path / "run.py").write_text(RUNNER)
    r = subprocess.run([sys.executable, str(tmp_path / "run.py"), str(repo), str(ROOT)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["baseline"] == "survived"  # the unmutated tests pass
    assert got["0"][0] == "killed" and "test_lib.py::test_add" in got["0"][1]
    assert got["1"][0] == "survived"  # b + a: equivalent
    assert got["2"][0] == "timeout"
    assert got["3"][0] == "survived"  # a bug the test's inputs never reach
    assert got["restored"] == [True, True]
    assert (repo / "lib.py").read_text() == "def add(a, b):\n    return a + b\n"  # the live tree untouched
