"""Teeth by source mutation: a copy of a pagedkit module with one realistic bug written in (an epsilon dropped, a
window start one key late, ...), loaded beside the real one for one test. The copy lives in the same package (its
relative imports resolve) under `<module>_mutant`, registered in sys.modules for the test only (monkeypatch), so
a second mutant may import it; the real module is never touched. @triton.jit kernels in the copy are new
JIT functions (the interpreter runs them; on CUDA they compile afresh)."""

from __future__ import annotations

import importlib.util
import sys


def edit(src: str, old: str, new: str, occurrence: int | None = None) -> str:
    """src with `old` replaced by `new`: the only occurrence, or the `occurrence`-th (0-based) of several."""
    n = src.count(old)
    if occurrence is None:
        assert n == 1, f"{old!r} occurs {n} times"
        return src.replace(old, new)
    assert n > occurrence, f"{old!r} occurs {n} times, wanted occurrence {occurrence}"
    at = -1
    for _ in range(occurrence + 1):
        at = src.index(old, at + 1)
    return src[:at] + new + src[at + len(old):]


def mutant(module, edits, tmp_path, monkeypatch):
    """A copy of `module` with `edits` ([(old, new) or (old, new, occurrence)]) applied, loaded as
    `<module>_mutant` (in sys.modules until the test ends)."""
    src = open(module.__file__).read()
    for e in edits:
        src = edit(src, *e)
    short = module.__name__.rsplit(".", 1)[1]
    path = tmp_path / f"{short}_mutant.py"
    path.write_text(src)
    name = module.__name__ + "_mutant"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod
