"""No silent skips in CI: under CI=true a skip caused by a missing module fails (tests/conftest.py), every
third-party module a test file imports is in tests/deps.py, and `python tests/deps.py` (run by .ci/run after
installing) exits 1 naming a missing one. Each check runs pytest / the script in a subprocess, on tiny test
files written here or on a real Triton test file with `import triton` made to fail."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deps
from deps import MISSING_MODULE_REASON, REQUIRED

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# the interpreter with `import triton` failing (a None entry in sys.modules), as on a machine without triton
BLOCK_TRITON = "import sys; sys.modules['triton'] = None; "

FILES = {
    "test_module_level.py": 'import pytest\npytest.importorskip("pagedkit_no_such_module")\n\ndef test_a():\n    pass\n',
    "test_inside.py": 'import pytest\n\ndef test_b():\n    pytest.importorskip("pagedkit_no_such_module_2")\n',
    "test_marks.py": ('import pytest\n\n@pytest.mark.skipif(True, reason="needs triton")\ndef test_c():\n    pass\n\n'
                      '@pytest.mark.skipif(True, reason="needs CUDA")\ndef test_cuda():\n    pass\n\n'
                      '@pytest.mark.gpu\ndef test_gpu_marked():\n    pass\n'),
}


def _env(ci: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT)])
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """pytest on the tiny files, with CI=true and without: {ci: (exit code, output)}. tests/conftest.py is
    loaded as a plugin (its hooks, nothing of the repo's configuration besides)."""
    folder = tmp_path_factory.mktemp("ci-strict")
    for name, text in FILES.items():
        (folder / name).write_text(text)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    out = {}
    for ci in (True, False):
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA", "-q",
                            "--continue-on-collection-errors", *FILES], cwd=folder, env=_env(ci),
                           capture_output=True, text=True, timeout=300)
        out[ci] = (r.returncode, r.stdout + r.stderr)
    return out


def test_import_skips_fail_under_ci(runs):
    """Module-level and in-test importorskip, and skipif(reason="needs triton"), fail under CI; a skip for
    missing CUDA and the gpu marker's skip (conftest.py, a CPU machine) stay skips."""
    code, out = runs[True]
    assert code == 1, out
    last = out.strip().splitlines()[-1]
    assert "1 failed" in last and "2 skipped" in last and "2 errors" in last, last
    assert "ERROR test_module_level.py - CI=true: a test dependency is missing" in out
    assert "could not import 'pagedkit_no_such_module'" in out
    assert "FAILED test_inside.py::test_b - CI=true: a test dependency is missing" in out
    assert "could not import 'pagedkit_no_such_module_2'" in out
    assert "ERROR test_marks.py::test_c - CI=true: a test dependency is missing" in out and "needs triton" in out
    assert "SKIPPED [1] test_marks.py:7: needs CUDA" in out
    assert "SKIPPED [1] test_marks.py:11: needs CUDA (run with -m gpu on the device)" in out


def test_outside_ci_a_missing_module_still_skips(runs):
    code, out = runs[False]
    assert code == 0 and "1 passed" not in out and "5 skipped" in out.strip().splitlines()[-1], out


def test_reason_pattern():
    assert MISSING_MODULE_REASON.search("could not import 'triton': No module named 'triton'")
    assert MISSING_MODULE_REASON.search("needs triton") and MISSING_MODULE_REASON.search("no onnxruntime_genai")
    for reason in ("needs CUDA", "onnxruntime has no CUDAExecutionProvider (needs onnxruntime-gpu)",
                   "triton without its NVIDIA backend", "PAGEDKIT_INT8_MMA overrides the default",
                   "needs CUDA (run with -m gpu on the device)"):
        assert not MISSING_MODULE_REASON.search(reason), reason


def test_triton_test_file_fails_without_triton_under_ci():
    """A real Triton test file with `import triton` failing: under CI an error naming triton, not a skip."""
    code = BLOCK_TRITON + "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', " \
                          "'tests/test_triton_swiglu.py']))"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(True), capture_output=True, text=True,
                       timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "ERROR tests/test_triton_swiglu.py" in out and "could not import 'triton'" in out, out[-3000:]


def test_deps_script_names_the_missing_module(capsys):
    assert deps.main() == 0 and f"all {len(REQUIRED)} import" in capsys.readouterr().out
    code = BLOCK_TRITON + f"import runpy; runpy.run_path({str(TESTS / 'deps.py')!r}, run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", code], env=_env(False), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISSING test dependency: `import triton` fails" in r.stderr and "triton==3.8.0" in r.stderr
    assert "1 test dependencies missing: triton" in r.stderr


def _third_party_imports(path: Path, local: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in ("importorskip", "import_module")
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        found |= {n.split(".")[0] for n in names}
    return {m for m in found if m not in sys.stdlib_module_names and m not in local}


def test_deps_lists_every_module_the_tests_import():
    local = {p.stem for p in TESTS.rglob("*.py")} | {p.name for p in TESTS.iterdir() if p.is_dir()} | {p.stem for p in (ROOT / "benchmarks").rglob("*.py")}
    local |= {"pagedkit", "benchmarks", "tools"}
    unlisted = {}
    for path in sorted(TESTS.rglob("*.py")):
        for mod in _third_party_imports(path, local) - set(REQUIRED):
            unlisted.setdefault(mod, []).append(path.name)
    assert not unlisted, f"add these to tests/deps.py REQUIRED: {unlisted}"
    assert {"triton", "onnxruntime_genai", "transformers", "onnx_ir", "onnxruntime"} <= set(REQUIRED)


def test_ci_runs_the_dependency_check_after_installing():
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    check = lines.index("python3 tests/deps.py")
    install = next(i for i, ln in enumerate(lines) if ln.startswith("python3 -m pip install") and "-e" in ln)
    tests = next(i for i, ln in enumerate(lines) if "python -m pytest" in ln)
    assert install < check < tests
    assert "set -euo pipefail" in lines
