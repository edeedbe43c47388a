"""A tensor-parallel set never hangs: a follower killed between steps ends the next step at once with one
TPError line naming the rank and the signal; a follower that stops answering ends it after the collective
timeout; `paged-run --tp 2` whose follower is killed mid-generation exits with one error line; a killed rank 0
takes its followers down; a rank's graph run outside a set refuses its collectives, naming the node.
(gloo, two processes; the collective timeout is shortened for the tests.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tp_harness as H

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = H.Case("LlamaConfig", (("max_position_embeddings", 4096),), seed=2).model()
    return H.export_pair(hf, tmp_path_factory.mktemp("tp-fail"))


def _running_set(folder, timeout: float):
    from pagedkit.runtime.distributed import TensorParallel
    from pagedkit.runtime.generate import Generator

    tp = TensorParallel(2, timeout=timeout, threads=1)
    gen = Generator(folder, session=tp.session(folder))
    assert len(list(gen.greedy(H.PROMPT, 2, stop_at_eos=False))) == 2  # the set works
    return tp, gen


def test_killed_follower_stops_the_next_step(llama):
    from pagedkit.runtime.distributed import TPError

    tp, gen = _running_set(llama[1], timeout=30)
    try:
        os.kill(tp.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TPError) as exc:
            list(gen.greedy(H.PROMPT, 2, stop_at_eos=False))
        took = time.monotonic() - t0
    finally:
        tp.close()
    msg = str(exc.value)
    assert "\n" not in msg and "rank 1 of 2 stopped (killed by SIGKILL)" in msg, msg
    assert took < 10, took  # at once, not after the 30 s timeout
    with pytest.raises(TPError, match="has stopped"):  # the set is over: no step runs on half of it
        tp.send(0, {})
    print(f"{msg} ({took:.2f} s)")


def test_hung_follower_times_out(llama):
    from pagedkit.runtime.distributed import TPError

    tp, gen = _running_set(llama[1], timeout=3)
    pid = tp.procs[0].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TPError) as exc:
            list(gen.greedy(H.PROMPT, 2, stop_at_eos=False))
        took = time.monotonic() - t0
    finally:
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)
        tp.close()
    msg = str(exc.value)
    assert "\n" not in msg and "within the 3 s collective timeout" in msg, msg
    assert 2.5 < took < 15, took
    print(f"{msg} ({took:.2f} s)")


def _followers(parent: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{d}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == parent and b"spawn_main" in cmd:
            kids.append(int(d))
    return kids


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)


def test_paged_run_killed_rank_ends_with_one_error_line(llama):
    p = subprocess.Popen([sys.executable, "-m", "pagedkit.apps.run.cli", str(llama[1]), "--prompt-ids", "5,6,7",
                          "--max-new-tokens", "4000", "--tp", "2", "--ignore-eos", "--threads", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(PAGEDKIT_TP_TIMEOUT="30"))
    try:
        seen = b""
        while b"prompt:" not in seen:  # generation has started (the first token flushed the line)
            chunk = os.read(p.stdout.fileno(), 4096)
            assert chunk, p.stderr.read().decode()
            seen += chunk
        kids = _followers(p.pid)
        assert len(kids) == 1, kids
        os.kill(kids[0], signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    lines = [line for line in err.decode().splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, lines)
    assert lines[0].startswith("paged-run: error: ") and "rank 1 of 2 stopped (killed by SIGKILL)" in lines[0]
    assert took < 15, took
    print(f"{lines[0]} ({took:.2f} s)")


def test_killed_rank0_takes_the_followers_down(llama):
    script = ("import sys, time\n"
              "from pagedkit.runtime.distributed import TensorParallel\n"
              "if __name__ == '__main__':\n"
              "    tp = TensorParallel(2, timeout=30, threads=1)\n"
              f"    tp.session({str(llama[1])!r})\n"
              "    print(tp.procs[0].pid, flush=True)\n"
              "    time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=_env())
    try:
        follower = int(p.stdout.readline())
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 15
        while not _gone(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(follower), "the follower outlived rank 0"
    finally:
        if p.poll() is None:
            p.kill()


def test_rank_graph_alone_refuses_its_collectives(llama):
    import numpy as np

    from pagedkit import InferenceSession
    from pagedkit.runtime.distributed import TPError
    from pagedkit.runtime.generate import Generator

    with pytest.raises(ValueError, match="tensor-parallel export of 2 ranks: run it with --tp 2"):
        Generator(llama[1])
    sess = InferenceSession(str(llama[1] / "rank_0" / "model.onnx"), cpu_backend="torch")
    feeds = {"input_ids": np.array([5], np.int64), "block_table": np.zeros((1, 1), np.int32),
             "cumulative_sequence_lengths": np.array([0, 1], np.int32),
             "past_sequence_lengths": np.array([0], np.int32), "attention_metadata": np.array([1, 1, 1], np.int32)}
    for a in sess.get_inputs():
        if a.name.startswith("past_key_values"):
            feeds[a.name] = np.zeros([1, 16] + a.shape[2:], np.float16)
    with pytest.raises(RuntimeError, match="AllReduce node '/model/layers.0/attn/AllReduce'.*--tp N") as exc:
        sess.run(["logits"], feeds)
    assert isinstance(exc.value.__cause__ or exc.value, (TPError, RuntimeError))
