"""Test-session setup. Without CUDA the Triton kernels run through Triton's interpreter: TRITON_INTERPRET=1 is
set here, before any test imports a kernel module (triton reads it when a kernel is decorated).

Under CI (CI=true, as .ci/run exports) a skip caused by a missing module is a failure: `pytest.importorskip`
and skip reasons naming a needed module (tests/deps.py) never pass CI as "skipped". The skip of `gpu`-marked
tests without CUDA stays a skip."""

import os

import pytest

from deps import MISSING_MODULE_REASON, in_ci


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A tiny random Llama (tests/export_utils.TINY) exported once per session; tests only read the folder."""
    pytest.importorskip("transformers")
    from export_utils import export_tiny, tiny_model

    out = tmp_path_factory.mktemp("tiny-llama") / "onnx"
    export_tiny(tiny_model("LlamaConfig"), out)
    return out


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _skip_reason(rep) -> str:
    lr = rep.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # (path, line, "Skipped: reason")
        return str(lr[2])
    return str(lr)


def _fail_missing_module_skip(rep) -> None:
    if rep.skipped and not hasattr(rep, "wasxfail") and in_ci():
        reason = _skip_reason(rep)
        if MISSING_MODULE_REASON.search(reason):
            rep.outcome = "failed"
            rep.longrepr = (f"CI=true: a test dependency is missing, which CI reports as a failure, not a skip: "
                            f"{reason} (install the test dependencies; `python tests/deps.py` lists what is missing)")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield  # a module-level importorskip / skip
    _fail_missing_module_skip(rep)
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield  # importorskip inside a test or fixture, skipif marks
    _fail_missing_module_skip(rep)
    return rep


_EXIT_REPORT = os.environ.get("TEST_EXIT_REPORT")  # a folder: why a (worker) process does not exit


def pytest_unconfigure(config):
    """With TEST_EXIT_REPORT=DIR (the device's gpu runs, whose xdist workers once stayed alive after the
    last test): each process writes its live threads and child processes to DIR/exit-PID.txt, and every
    thread's stack there again if it is still alive 20 s later."""
    if not _EXIT_REPORT:
        return
    import faulthandler
    import threading

    os.makedirs(_EXIT_REPORT, exist_ok=True)
    f = open(os.path.join(_EXIT_REPORT, f"exit-{os.getpid()}.txt"), "w")
    for t in threading.enumerate():
        f.write(f"thread {t.name!r} daemon={t.daemon} alive={t.is_alive()}\n")
    try:
        kids = os.popen(f"ps -o pid,stat,etime,cmd --ppid {os.getpid()}").read()
    except OSError as exc:
        kids = str(exc)
    f.write(f"children:\n{kids}\n")
    f.flush()
    faulthandler.dump_traceback_later(20, exit=False, file=f)
