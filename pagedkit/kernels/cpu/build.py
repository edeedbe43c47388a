"""The CPU attention library (paged_attention.c: PagedAttention as one onnxruntime custom op), compiled once per
machine and source with the system's C compiler and cached under $PAGEDKIT_CACHE/cpu_kernels.

    path, why = library()       # (path of the shared library, "") or (None, why it is not available)

The build takes about half a second (gcc, -O3 -march=native); the file name carries a hash of the source, the
compiler, the flags and the CPU's feature flags, so a cache folder shared by machines of different CPUs never
hands one a library built for another. Written to a temporary name and renamed: concurrent builds are safe.
PAGEDKIT_CPU_ATTENTION=decompose (pagedkit/settings.py) turns the library off.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from ... import settings

SOURCE = Path(__file__).with_name("paged_attention.c")
HEADERS = (Path(__file__).with_name("simd.h"), Path(__file__).with_name("pool.h"))
FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-fno-math-errno")
NATIVE = ("-march=native",)
COMPILERS = ("cc", "gcc", "clang")
_RESULT: tuple[str | None, str] | None = None


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> tuple[str | None, str]:
    for name in COMPILERS:
        exe = shutil.which(name)
        if exe:
            try:
                ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            return exe, (ver.splitlines() or [""])[0]
    return None, ""


def _cache_dir() -> Path:
    root = settings.read("PAGEDKIT_CACHE") / "cpu_kernels"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return root
    except OSError:  # a read-only cache: a private folder for this process
        return Path(tempfile.mkdtemp(prefix="pagedkit-cpu-kernels-"))


def build(out_dir: Path | None = None, source_dir: Path | None = None) -> tuple[str | None, str]:
    """Compile the library (or find it built) -> (path, "") or (None, why not). source_dir: a folder holding
    another paged_attention.c / simd.h (the tests' mutants)."""
    if platform.system() not in ("Linux", "Darwin"):
        return None, f"the CPU attention library is built on Linux and macOS only, not {platform.system()}"
    exe, version = _compiler()
    if exe is None:
        return None, f"no C compiler on PATH ({' / '.join(COMPILERS)})"
    files = [Path(source_dir) / p.name if source_dir else p for p in (SOURCE, *HEADERS)]
    source = b"".join(p.read_bytes() for p in files)
    suffix = ".dylib" if platform.system() == "Darwin" else ".so"
    errors = []
    for flags in (FLAGS + NATIVE, FLAGS):  # -march=native first; a compiler without it builds generic code
        key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                         platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:16]
        folder = out_dir or _cache_dir()
        target = folder / f"paged_attention-{key}{suffix}"
        if target.is_file():
            return str(target), ""
        tmp = folder / f"{target.name}.{os.getpid()}.tmp"
        cmd = [exe, *flags, "-o", str(tmp), str(files[0]), "-lm", "-ldl"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if proc.returncode == 0 and tmp.is_file():
            os.replace(tmp, target)
            return str(target), ""
        tmp.unlink(missing_ok=True)
        errors.append((proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1][:200])
    return None, f"{Path(exe).name} failed: {'; '.join(errors)}"


def library() -> tuple[str | None, str]:
    """The library's path, built on first use (once per process), or None and why it is not used."""
    global _RESULT
    if settings.read("PAGEDKIT_CPU_ATTENTION") == "decompose":
        return None, "PAGEDKIT_CPU_ATTENTION=decompose"
    if _RESULT is None:
        _RESULT = build()
    return _RESULT


__all__ = ["SOURCE", "build", "library"]
