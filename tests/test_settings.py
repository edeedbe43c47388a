"""pagedkit/settings.py: every environment variable declared once and read through it alone (issue 35).

- only the settings module touches the environment (os.environ / os.getenv / ... in any form); a fake offender
  of each form is caught, with the PAGEDKIT_* name it reads, literal or built from a constant;
- every settings.read() names a declared variable, import-time variables are read at module level and the
  others inside functions, every declaration is used, and every PAGEDKIT_* name in the code and the docs exists;
- each variable's parsing rules (the semantics the modules had before they read through settings);
- `python -m pagedkit.settings` prints them all; docs/settings.md is generated from the declarations and current.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkit import settings
from pagedkit.settings import SETTINGS

REPO = Path(__file__).resolve().parent.parent
ROOT = REPO / "pagedkit"
SETTINGS_FILE = ROOT / "settings.py"
ENV_ATTRS = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
NAME_RE = re.compile(r"\bPAGEDKIT_[A-Z0-9_]+\b(?!\*)")
# Python names of pagedkit that look like variables and are not (the genai_config section's key and version)
NOT_VARIABLES = {"PAGEDKIT_KEY", "PAGEDKIT_CONFIG_VERSION"}


# ---- only the settings module touches the environment -----------------------------------------------------------

def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "string" assignments."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def environment_uses(source: str, filename: str = "<source>") -> list[str]:
    """Every use of the process environment in `source`: an attribute environ / getenv / putenv / ... (os.environ,
    an alias of os, posix), or such a name imported from os; each as "LINE: statement [PAGEDKIT_* names it reads,
    literal or through a module constant]"."""
    tree = ast.parse(source, filename)
    constants = _constants(tree)
    statement_of: dict[int, ast.stmt] = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt):
            for sub in ast.walk(stmt):
                statement_of[id(sub)] = stmt  # the innermost statement wins (walked after its parents)
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in ("os", "posix", "nt") for a in node.names if a.name in ENV_ATTRS}
    found = []
    for node in ast.walk(tree):
        hit = (isinstance(node, ast.Attribute) and node.attr in ENV_ATTRS) or (
            isinstance(node, ast.Name) and node.id in imported) or (
            isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt")
            and any(a.name in ENV_ATTRS for a in node.names))
        if not hit:
            continue
        stmt = statement_of[id(node)]
        names = set()
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                names |= set(NAME_RE.findall(sub.value)) | ({sub.value} if sub.value == "PAGEDKIT_" else set())
            elif isinstance(sub, (ast.Name, ast.Attribute)):
                value = constants.get(sub.id if isinstance(sub, ast.Name) else sub.attr, "")
                names |= {value} if value.startswith("PAGEDKIT_") else set()
        text = ast.unparse(stmt).splitlines()[0][:100]
        found.append(f"{node.lineno}: {text}" + (f" [{', '.join(sorted(names))}]" if names else ""))
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def scan_tree(root: Path) -> dict[str, list[str]]:
    """environment_uses of every module under `root` (a pagedkit/ folder) but its settings.py."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        if path == root / "settings.py":
            continue
        uses = environment_uses(path.read_text(encoding="utf-8"), str(path))
        if uses:
            out[str(path.relative_to(root.parent))] = uses
    return out


def test_only_the_settings_module_touches_the_environment():
    bad = scan_tree(ROOT)
    assert not bad, ("read / set environment variables through pagedkit/settings.py (declare them there):\n" +
                     "\n".join(f"{path}:{use}" for path, uses in bad.items() for use in uses))
    assert environment_uses(SETTINGS_FILE.read_text(encoding="utf-8"))  # the one module that does


_OFFENDERS = {
    "literal.py": 'import os\nX = os.environ.get("PAGEDKIT_FOO", "1") == "1"\n',
    "subscript.py": 'import os\n\n\ndef f():\n    return os.environ["PAGEDKIT_FOO"]\n',
    "constant.py": 'import os\nNAME = "PAGEDKIT_FOO"\n\n\ndef f():\n    return os.getenv(NAME)\n',
    "imported.py": 'from os import environ as env\nY = env.get("PAGEDKIT_" + "FOO")\n',
    "alias.py": 'import os as o\nZ = {k: v for k, v in o.environ.items() if k.startswith("PAGEDKIT_")}\n',
    "fstring.py": 'import os\nW = os.environ.get(f"PAGEDKIT_{1}")\n',
    "setter.py": 'import os\nos.environ.setdefault("HF_HUB_OFFLINE", "1")\n',
}


def test_a_fake_offender_of_each_form_is_caught(tmp_path):
    """A tree with the settings module (allowed), a clean module, and one offender per form."""
    pkg = tmp_path / "pagedkit"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "settings.py").write_text('import os\nA = os.environ.get("PAGEDKIT_FOO")\n')
    (pkg / "clean.py").write_text('import os\nfrom . import settings\nPAGEDKIT_KEY = "pagedkit"\n'
                                  'DEBUG = settings.read("PAGEDKIT_DEBUG")\nP = os.path.join("a", "b")\n'
                                  'ENV = settings.offline_env("HF_HUB_OFFLINE")\n')
    for name, src in _OFFENDERS.items():
        (pkg / "sub" / name).write_text(src)
    got = scan_tree(pkg)
    assert set(got) == {f"pagedkit/sub/{n}" for n in _OFFENDERS}, got
    assert got["pagedkit/sub/literal.py"] == [
        "2: X = os.environ.get('PAGEDKIT_FOO', '1') == '1' [PAGEDKIT_FOO]"]
    assert got["pagedkit/sub/subscript.py"] == ["5: return os.environ['PAGEDKIT_FOO'] [PAGEDKIT_FOO]"]
    assert got["pagedkit/sub/constant.py"] == ["6: return os.getenv(NAME) [PAGEDKIT_FOO]"]  # through the constant
    assert got["pagedkit/sub/imported.py"] == ["1: from os import environ as env",  # the import and the read
                                               "2: Y = env.get('PAGEDKIT_' + 'FOO') [PAGEDKIT_]"]
    assert got["pagedkit/sub/alias.py"][0].endswith("[PAGEDKIT_]")
    assert got["pagedkit/sub/fstring.py"] == ["2: W = os.environ.get(f'PAGEDKIT_{1}') [PAGEDKIT_]"]
    assert got["pagedkit/sub/setter.py"] == ["2: os.environ.setdefault('HF_HUB_OFFLINE', '1')"]


# ---- every read names a declared variable, at the time its declaration says ------------------------------------

def _settings_calls() -> tuple[list[tuple[str, str, ast.Call, bool]], list[str]]:
    """(module file, function, call, at module level) for every settings.<function>(...) outside settings.py,
    and every import of one of those functions by name (which the scan would not see)."""
    out, by_name = [], []
    for path in sorted(ROOT.rglob("*.py")):
        if path == SETTINGS_FILE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        inside: set[int] = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inside |= {id(n) for n in ast.walk(fn) if n is not fn}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "settings"):
                out.append((str(path.relative_to(REPO)), node.func.attr, node, id(node) not in inside))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("settings"):
                taken = {a.name for a in node.names} & {"read", "stay_offline", "offline_env", "pagedkit_environment"}
                by_name += [f"{path.relative_to(REPO)}:{node.lineno} imports {t}" for t in sorted(taken)]
    return out, by_name


CALLS, IMPORTED_BY_NAME = _settings_calls()


def test_the_settings_functions_are_called_as_settings_dot_name():
    """What the two tests below scan for: settings.read("NAME"), never a bare read imported by name."""
    assert not IMPORTED_BY_NAME, IMPORTED_BY_NAME
    assert len([c for c in CALLS if c[1] == "read"]) >= len(SETTINGS) - 4


def test_every_read_names_a_declared_variable_at_its_time():
    from pagedkit.exporters.fetch import FETCHABLE

    dynamic = []
    for path, func, call, top in CALLS:
        if func != "read":
            continue
        arg = call.args[0]
        if not isinstance(arg, ast.Constant):
            dynamic.append(path)
            continue
        s = SETTINGS.get(arg.value)
        assert s is not None, f"{path}:{call.lineno}: {arg.value} is not declared in pagedkit/settings.py"
        assert s.when != "set", f"{path}:{call.lineno}: {s.name} is set by pagedkit, not read"
        assert top == (s.when == "import"), (f"{path}:{call.lineno}: {s.name} is declared as read "
                                             f"{settings.WHEN[s.when]}, but this read is {'not ' * (not top)}"
                                             "at module level")
    assert dynamic == ["pagedkit/exporters/fetch.py"]  # the wheel of each fetchable model
    assert all(SETTINGS[spec.wheel_env].when == "call" for spec in FETCHABLE.values())


def test_every_declaration_is_used():
    from pagedkit.exporters.fetch import FETCHABLE

    read = {c.args[0].value for _, f, c, _ in CALLS if f == "read" and isinstance(c.args[0], ast.Constant)}
    read |= {spec.wheel_env for spec in FETCHABLE.values()}
    set_ = {a.value for _, f, c, _ in CALLS if f in ("stay_offline", "offline_env") for a in c.args}
    assert {n for n, s in SETTINGS.items() if s.when == "set"} == set_
    unused = sorted(n for n, s in SETTINGS.items() if s.when != "set" and n not in read)
    assert not unused, f"declared, never read: {unused} (remove the declaration with the knob)"


def _names_in(paths) -> dict[str, set[str]]:
    out = {}
    for path in paths:
        names = set(NAME_RE.findall(path.read_text(encoding="utf-8"))) - NOT_VARIABLES
        if names:
            out[str(path.relative_to(REPO))] = names
    return out


DOCS = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md", REPO / "benchmarks" / "README.md"]


def test_every_name_in_the_code_and_the_docs_is_declared():
    """A variable named in a comment, a docstring or a doc page exists (a removed knob leaves no mention)."""
    import importlib

    genai_config = importlib.import_module("pagedkit.interface.genai_config")
    assert all(hasattr(genai_config, n) for n in NOT_VARIABLES)
    code = [*ROOT.rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]
    stale = {path: sorted(names - set(SETTINGS)) for path, names in _names_in([*code, *DOCS]).items()
             if names - set(SETTINGS)}
    assert not stale, f"not pagedkit settings (declare them in pagedkit/settings.py or drop them): {stale}"


def test_pages_that_name_knobs_link_to_the_settings_page():
    """A page naming a tuning knob, or more than one setting, links to docs/settings.md for their list."""
    unlinked = []
    for path, names in _names_in(DOCS).items():
        if path == "docs/settings.md":
            continue
        tuning = any(SETTINGS[n].kind == "tuning" for n in names)
        if (tuning or len(names) > 1) and "settings.md" not in (REPO / path).read_text(encoding="utf-8"):
            unlinked.append(path)
    assert not unlinked, f"name settings without linking docs/settings.md: {unlinked}"


# ---- each variable's parsing rules --------------------------------------------------------------------------------

HOME = Path.home()
CASES = [  # (variable, value in the environment or None (unset), what the code gets)
    ("PAGEDKIT_DEBUG", None, False), ("PAGEDKIT_DEBUG", "1", True), ("PAGEDKIT_DEBUG", "yes", True),
    ("PAGEDKIT_DEBUG", "2", True), ("PAGEDKIT_DEBUG", "0", False), ("PAGEDKIT_DEBUG", " False ", False),
    ("PAGEDKIT_DEBUG", "no", False), ("PAGEDKIT_DEBUG", "", False),
    ("PAGEDKIT_KERNEL_DEBUG", "1", True), ("PAGEDKIT_KERNEL_DEBUG", "true", True),
    ("PAGEDKIT_KERNEL_DEBUG", "0", False), ("PAGEDKIT_KERNEL_DEBUG", None, False),
    ("PAGEDKIT_VALIDATE_INPUTS", "1", True), ("PAGEDKIT_VALIDATE_INPUTS", "TRUE", True),
    ("PAGEDKIT_VALIDATE_INPUTS", " on", True), ("PAGEDKIT_VALIDATE_INPUTS", "2", False),
    ("PAGEDKIT_VALIDATE_INPUTS", None, False),
    ("PAGEDKIT_CPU_BACKEND", " Torch ", "torch"), ("PAGEDKIT_CPU_BACKEND", "mlas", "mlas"),  # session refuses it
    ("PAGEDKIT_CPU_BACKEND", "  ", None), ("PAGEDKIT_CPU_BACKEND", None, None),
    ("PAGEDKIT_CPU_ATTENTION", None, "auto"), ("PAGEDKIT_CPU_ATTENTION", " Kernel ", "kernel"),
    ("PAGEDKIT_CPU_ATTENTION", "decompose", "decompose"),
    ("PAGEDKIT_MATMULNBITS", None, "auto"), ("PAGEDKIT_MATMULNBITS", " EXACT", "exact"),
    ("PAGEDKIT_MATMULNBITS", " ", "auto"),
    ("PAGEDKIT_DEQUANT_CACHE_MB", "0", 0.0), ("PAGEDKIT_DEQUANT_CACHE_MB", "1.5", 1.5),
    ("PAGEDKIT_DEQUANT_CACHE_MB", None, None),
    ("PAGEDKIT_CACHE", None, HOME / ".cache" / "pagedkit"), ("PAGEDKIT_CACHE", "", HOME / ".cache" / "pagedkit"),
    ("PAGEDKIT_CACHE", "~/models", HOME / "models"), ("PAGEDKIT_CACHE", "/data/c", Path("/data/c")),
    ("PAGEDKIT_SMOLLM2_WHEEL", "/w/a.whl", "/w/a.whl"), ("PAGEDKIT_SMOLLM2_WHEEL", None, None),
    ("PAGEDKIT_COMMIT", "abc123", "abc123"), ("PAGEDKIT_COMMIT", "", None),
    ("PAGEDKIT_API_KEY", "sk-local", "sk-local"), ("PAGEDKIT_API_KEY", "", None),
    ("PAGEDKIT_TP_TIMEOUT", None, 300.0), ("PAGEDKIT_TP_TIMEOUT", "2.5", 2.5),
    ("PAGEDKIT_DECODE_TILE", None, None), ("PAGEDKIT_DECODE_TILE", "64x4", (64, 4)),
    ("PAGEDKIT_DECODE_WAVES", "6", 6.0), ("PAGEDKIT_DECODE_WAVES", None, None),
    ("PAGEDKIT_DECODE_STAGES", "3", 3), ("PAGEDKIT_DECODE_STAGES", None, None),
    ("PAGEDKIT_QUANT_DECODE_TILE", None, (64, 2)), ("PAGEDKIT_QUANT_DECODE_TILE", "0", None),
    ("PAGEDKIT_QUANT_DECODE_TILE", "32x1", (32, 1)),
    ("PAGEDKIT_QUANT_DECODE_WAVES", None, 4.0), ("PAGEDKIT_QUANT_DECODE_WAVES", "12", 12.0),
    ("PAGEDKIT_QUANT_TILE", None, (128, 4)), ("PAGEDKIT_QUANT_WAVES", None, None),
    ("PAGEDKIT_QUANT_WAVES", "2.5", 2.5), ("PAGEDKIT_QUANT_STAGES", None, None),
    ("PAGEDKIT_QUANT_ASM", None, {"int8": "v", "fp8": "v", "int4": "v"}),
    ("PAGEDKIT_QUANT_ASM", "0", {"int8": "", "fp8": "", "int4": ""}),
    ("PAGEDKIT_QUANT_ASM", "int8:v,fp8:0", {"int8": "v", "fp8": "", "int4": "kv"}),
    ("PAGEDKIT_INT8_MMA", None, "k"), ("PAGEDKIT_INT8_MMA", "1", "kv"), ("PAGEDKIT_INT8_MMA", "0", ""),
    ("PAGEDKIT_INT8_MMA", "v", "v"),
    ("PAGEDKIT_PDL", None, True), ("PAGEDKIT_PDL", "0", False), ("PAGEDKIT_PDL", "no", True),
    ("PAGEDKIT_PDL_MAX_PROGRAMS", None, 0), ("PAGEDKIT_PDL_MAX_PROGRAMS", "8", 8),
    ("PAGEDKIT_PDL_LATE", None, True), ("PAGEDKIT_PDL_LATE", "0", False), ("PAGEDKIT_PDL_LATE", "1", True),
    ("PAGEDKIT_BLAS", "cublaslt", "cublaslt"), ("PAGEDKIT_BLAS", "", None), ("PAGEDKIT_BLAS", None, None),
    ("PAGEDKIT_DECODE_LINEAR", None, "measured"), ("PAGEDKIT_DECODE_LINEAR", "1", True),
    ("PAGEDKIT_DECODE_LINEAR", "0", False), ("PAGEDKIT_DECODE_LINEAR", "Measured", "measured"),
    ("PAGEDKIT_MOE_ROUTE_KERNEL", None, True), ("PAGEDKIT_MOE_ROUTE_KERNEL", "0", False),
    ("PAGEDKIT_MOE_ROUTE_KERNEL", "1", True),
    ("PAGEDKIT_L2_PREFETCH", None, {"mb": 4.0, "at": "late", "mode": "bulk", "distance": 1}),
    ("PAGEDKIT_L2_PREFETCH", "off", None), ("PAGEDKIT_L2_PREFETCH", "0", None),
    ("PAGEDKIT_L2_PREFETCH", "16:early:d2", {"mb": 16.0, "at": "early", "mode": "bulk", "distance": 2}),
    ("TRITON_INTERPRET", "1", True), ("TRITON_INTERPRET", "true", False), ("TRITON_INTERPRET", None, False),
]


@pytest.mark.parametrize("name, given, want", CASES, ids=[f"{n}={g!r}" for n, g, _ in CASES])
def test_parsing(name, given, want):
    env = {} if given is None else {name: given}
    assert SETTINGS[name].value(env) == want


def test_every_variable_has_parsing_cases():
    assert {n for n, s in SETTINGS.items() if s.when != "set"} <= {n for n, _, _ in CASES}


@pytest.mark.parametrize("name, given, message", [
    ("PAGEDKIT_DECODE_TILE", "64", "PAGEDKIT_DECODE_TILE='64': expected BNxNW, e.g. 64x4"),
    ("PAGEDKIT_DECODE_STAGES", "three", "PAGEDKIT_DECODE_STAGES='three': invalid literal"),
    ("PAGEDKIT_MATMULNBITS", "fast", "PAGEDKIT_MATMULNBITS='fast': expected auto, exact, int4 or off"),
    ("PAGEDKIT_CPU_ATTENTION", "c", "PAGEDKIT_CPU_ATTENTION='c': expected auto, kernel or decompose"),
    ("PAGEDKIT_DEQUANT_CACHE_MB", "lots", "PAGEDKIT_DEQUANT_CACHE_MB='lots': could not convert"),
    ("PAGEDKIT_TP_TIMEOUT", "soon", "PAGEDKIT_TP_TIMEOUT='soon': could not convert"),
    ("PAGEDKIT_PDL_MAX_PROGRAMS", "x", "PAGEDKIT_PDL_MAX_PROGRAMS='x': invalid literal"),
    ("PAGEDKIT_L2_PREFETCH", "16:soon", "PAGEDKIT_L2_PREFETCH='16:soon': 'soon': expected early, late"),
    ("PAGEDKIT_DECODE_LINEAR", "on", "PAGEDKIT_DECODE_LINEAR='on': expected 0, 1 or measured"),
    ("PAGEDKIT_QUANT_ASM", "int9:v", "PAGEDKIT_QUANT_ASM: cache format 'int9' should be one of"),
    ("PAGEDKIT_INT8_MMA", "q", "PAGEDKIT_INT8_MMA='q': the sides: expected k, v, kv or 0, got 'q'"),
])
def test_a_bad_value_is_refused_naming_the_variable(monkeypatch, name, given, message):
    monkeypatch.setenv(name, given)
    with pytest.raises(ValueError) as err:
        settings.read(name)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_read_refuses_an_undeclared_name():
    with pytest.raises(KeyError, match="PAGEDKIT_NOPE is not declared in pagedkit/settings.py"):
        settings.read("PAGEDKIT_NOPE")


def test_declarations_are_whole():
    for s in SETTINGS.values():
        assert s.doc.strip() and s.type.strip(), s.name
        assert s.default is not None or s.unset, f"{s.name}: no default and no word on what unset means"
        if s.default is not None:
            s.value({})  # the default parses


def test_quant_asm_names_the_kernels_formats():
    from pagedkit.kernels.triton import decode

    assert set(settings.QUANT_ASM_FORMATS) == set(decode._FMT_NAMES)


# ---- the modules get what the settings say -------------------------------------------------------------------

_IMPORT_TIME = """
import json
from pagedkit.kernels.triton import common, decode
print(json.dumps([decode.DECODE_TILE, decode.QUANT_DECODE_TILE, decode.QUANT_ASM, decode.INT8_MMA, common.PDL,
                  common.PDL_EARLY_RELEASE]))
"""


def test_import_time_variables_reach_the_module_constants():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKIT_")} | {
        "PAGEDKIT_DECODE_TILE": "64x4", "PAGEDKIT_QUANT_DECODE_TILE": "0", "PAGEDKIT_QUANT_ASM": "int8:v,fp8:0",
        "PAGEDKIT_INT8_MMA": "1", "PAGEDKIT_PDL": "0", "PAGEDKIT_PDL_LATE": "0"}
    out = subprocess.run([sys.executable, "-c", _IMPORT_TIME], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == [[64, 4], None, {"1": "v", "2": "", "3": "kv"}, "kv", False, True]


def test_per_call_variables_are_read_at_each_use(monkeypatch, capsys):
    from pagedkit import cli_errors
    from pagedkit.apps.bench import report
    from pagedkit.interface.paths import model_cache_root
    from pagedkit.kernels import dispatch
    from pagedkit.kernels.triton import sdpa_prefill

    monkeypatch.setenv("PAGEDKIT_DEBUG", "yes")
    assert cli_errors.debug()
    monkeypatch.setenv("PAGEDKIT_DEBUG", "no")
    assert not cli_errors.debug()
    monkeypatch.setenv("PAGEDKIT_CACHE", "~/elsewhere")
    assert model_cache_root() == HOME / "elsewhere"
    monkeypatch.setenv("PAGEDKIT_COMMIT", "c0ffee")
    monkeypatch.setenv("PAGEDKIT_SOMETHING_ELSE", "1")
    assert report.pagedkit_commit() == "c0ffee"
    assert report.settings_env().get("PAGEDKIT_SOMETHING_ELSE") == "1" and "PAGEDKIT_COMMIT" not in report.settings_env()
    variant = dispatch.variants()[0]
    monkeypatch.setattr(dispatch, "_reported", set())
    monkeypatch.setattr(sdpa_prefill, "_reported", set())
    monkeypatch.delenv("PAGEDKIT_KERNEL_DEBUG", raising=False)
    dispatch._debug("n0", "PagedAttention", variant, "decode")
    sdpa_prefill._route("probe")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("PAGEDKIT_KERNEL_DEBUG", "true")  # one rule for both (sdpa_prefill took only "1" before)
    dispatch._debug("n0", "PagedAttention", variant, "decode")
    sdpa_prefill._route("probe")
    err = capsys.readouterr().err
    assert f"node 'n0': kernel={variant.name} plan=decode" in err and "sdpa_prefill route=probe" in err


def test_stay_offline_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    settings.stay_offline("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    import os

    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "0"
    env = settings.offline_env("TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")  # a child's: forced
    assert env["TRANSFORMERS_OFFLINE"] == "1" and env["HF_DATASETS_OFFLINE"] == "1" and "PATH" in env
    assert os.environ["TRANSFORMERS_OFFLINE"] == "0"
    with pytest.raises(AssertionError):
        settings.stay_offline("PAGEDKIT_DEBUG")


# ---- python -m pagedkit.settings and docs/settings.md -------------------------------------------------------------

def test_the_command_prints_every_variable():
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDKIT_")} | {
        "PAGEDKIT_DECODE_TILE": "64x4", "PAGEDKIT_DECODE_TLIE": "64x4", "PAGEDKIT_MATMULNBITS": "fast"}
    out = subprocess.run([sys.executable, "-m", "pagedkit.settings"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert set(SETTINGS) | {"PAGEDKIT_DECODE_TLIE"} == set(lines)
    assert "tuning" in lines["PAGEDKIT_DECODE_TILE"] and "set '64x4' -> (64, 4)" in lines["PAGEDKIT_DECODE_TILE"]
    assert "unset: (64, 2)" in lines["PAGEDKIT_QUANT_DECODE_TILE"]
    assert "error: PAGEDKIT_MATMULNBITS='fast'" in lines["PAGEDKIT_MATMULNBITS"]
    assert "not a pagedkit setting" in lines["PAGEDKIT_DECODE_TLIE"]
    assert "user" in lines["PAGEDKIT_CACHE"] and "external" in lines["TRITON_INTERPRET"]


def test_committed_settings_doc_is_current():
    assert settings.DOC_PATH == REPO / "docs" / "settings.md"
    assert settings.main(["--check"]) == 0, f"stale docs/settings.md; regenerate it with `{settings.COMMAND}`"


def test_settings_doc_check_mode(tmp_path, capsys):
    out = tmp_path / "settings.md"
    assert settings.main(["--out", str(out), "--check"]) == 1
    assert "regenerate with" in capsys.readouterr().out
    assert settings.main(["--doc", "--out", str(out)]) == 0 and settings.main(["--out", str(out), "--check"]) == 0
    text = out.read_text()
    for s in SETTINGS.values():
        row = next(line for line in text.splitlines() if line.startswith(f"| `{s.name}` |"))
        assert f"| {s.when} |" in row and (s.default is None or f"`{s.default}`" in row), row
    for title in settings.KINDS.values():
        assert f"## {title}" in text
