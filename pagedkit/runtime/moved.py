"""Deprecated import paths of what moved out of pagedkit.runtime (issue 35): the engine and the apps above it.

    pagedkit.runtime.engine[.X]  ->  pagedkit.engine[.X]
    pagedkit.runtime.serve[.X]   ->  pagedkit.apps.serve[.X]
    pagedkit.runtime.bench[.X]   ->  pagedkit.apps.bench[.X]
    pagedkit.runtime.cli         ->  pagedkit.apps.run.cli      (`python -m pagedkit.runtime.cli` too)

An old name resolves, on its first import, to the very module of the new name (`pagedkit.runtime.engine is
pagedkit.engine`, so a monkeypatch through either reaches the same object) and warns once per moved package
(DeprecationWarning naming the new path). It is lazy: `import pagedkit.runtime` installs the finder below and
imports nothing of the layers above; the new module is imported only when an old name is. These are the only
references of the runtime to the layers above it (tests/test_layers.py lists them as its one exception).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

# old package or module -> new one; a submodule of an old package maps to the same submodule of the new one
MOVED = {
    "pagedkit.runtime.engine": "pagedkit.engine",
    "pagedkit.runtime.serve": "pagedkit.apps.serve",
    "pagedkit.runtime.bench": "pagedkit.apps.bench",
    "pagedkit.runtime.cli": "pagedkit.apps.run.cli",
}
_warned: set[str] = set()


def new_name(old: str) -> str | None:
    """The new module name of an old one (None when `old` did not move)."""
    for o, n in MOVED.items():
        if old == o or old.startswith(o + "."):
            return n + old[len(o):]
    return None


def _importlib_frame(frame) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def _warn_once(old: str) -> None:
    root = next(o for o in MOVED if old == o or old.startswith(o + "."))
    if root in _warned:
        return
    _warned.add(root)
    # point the warning at the importing line: the first frame outside this file and the import machinery
    # (importlib.import_module included); warnings.warn itself steps over importlib's _bootstrap frames, so the
    # level does not count them
    frame, level = sys._getframe(1), 2
    skip = (__file__, importlib.__file__)
    while frame is not None and (_importlib_frame(frame) or frame.f_code.co_filename in skip):
        frame = frame.f_back
        level += frame is not None and not _importlib_frame(frame)
    warnings.warn(f"{root} is deprecated: it moved to {MOVED[root]} (import {new_name(old)} instead of {old})",
                  DeprecationWarning, stacklevel=level)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the module of its new name (imported on the way), not as a copy."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        _warn_once(spec.name)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module):
        module.__spec__ = self._spec  # module_from_spec set the alias spec on the real module: restore its own

    def get_code(self, fullname):
        """`python -m OLD` (runpy): run the new module as __main__, with its own package for relative imports."""
        _warn_once(fullname)
        return compile(f"import runpy\nrunpy.run_module({self.new!r}, run_name='__main__', alter_sys=True)\n",
                       f"<alias {fullname} -> {self.new}>", "exec")


class _AliasFinder(importlib.abc.MetaPathFinder):
    """First on sys.meta_path so that a stale folder of an old package (a leftover __pycache__/, which the path
    finder would take for a namespace package) cannot shadow the alias; a string test for every other name."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("pagedkit.runtime."):
            return None
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new))


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
