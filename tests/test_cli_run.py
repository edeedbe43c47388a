"""`paged-run`: greedy generation over a model folder, streaming tokens and a tokens/s summary, --prompt through
the folder's tokenizer, --parity against Hugging Face eager (exit 0 on parity, 1 on a mismatch), clear exit 2
on bad arguments.

The tokens of examples/tiny-paged are checked against an independent greedy loop that feeds the session by
hand (contiguous blocks, no block manager); parity runs use onnxruntime-genai builder models of a local
random checkpoint (shared with test_genai_run.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedkit import InferenceSession
from pagedkit.apps.run.cli import main
from pagedkit.runtime.generate import Generator

ROOT = Path(__file__).resolve().parents[1]
TINY_PAGED = ROOT / "examples" / "tiny-paged"


def _ids(out: str) -> list[int]:
    line = next(l for l in out.splitlines() if l.startswith("ids: "))
    return [int(t) for t in re.findall(r"-?\d+", line[len("ids: "):])]


def hand_greedy(model_dir: Path, prompt: list[int], n: int, block_size: int = 16, num_blocks: int = 4) -> list[int]:
    """Greedy decoding with hand-made feeds: one sequence in blocks 0, 1, ... of zero-initialised caches."""
    sess = InferenceSession(model_dir / "model.onnx")
    caches = {a.name: np.zeros((num_blocks, block_size) + tuple(a.shape[2:]), np.float16)
              for a in sess.get_inputs() if a.name.startswith("past_key_values.")}
    table = np.arange(num_blocks, dtype=np.int32)[None]
    ids, past, out = list(prompt), 0, []
    for _ in range(n):
        q = len(ids)
        feeds = {"input_ids": np.array(ids, np.int64), "block_table": table,
                 "cumulative_sequence_lengths": np.array([0, q], np.int32),
                 "past_sequence_lengths": np.array([past], np.int32),
                 "attention_metadata": np.array([q, past + q, past + q], np.int32), **caches}
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
        caches = {k: res[k.replace("past_key_values", "present")] for k in caches}
        out.append(int(np.argmax(res["logits"][-1].astype(np.float32))))
        past, ids = past + q, [out[-1]]
    return out


def test_tiny_paged_tokens_match_a_hand_fed_greedy_loop(capsys):
    assert main([str(TINY_PAGED), "--prompt-ids", "1, 7,9,30", "--max-new-tokens", "6", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    tokens = _ids(out)
    assert tokens == hand_greedy(TINY_PAGED, [1, 7, 9, 30], 6)
    assert "prompt: 4 tokens [1, 7, 9, 30]" in out
    streamed = out.splitlines()[2].split()  # tokens printed as they came, before the summary
    assert [int(t) for t in streamed] == tokens
    assert re.search(r"generated 6 tokens: prefill 4 tokens in [\d.]+ s, decode 5 tokens in [\d.]+ s "
                     r"\([\d.]+ tokens/s\)", out), out
    assert "paged layout, 2 layers, float16" in out


def test_generation_stops_at_eos():
    gen = Generator(TINY_PAGED)
    first = next(iter(gen.greedy([1, 7, 9, 30], 5))).token
    gen.config.eos_token_ids = [first]
    assert [s.token for s in gen.greedy([1, 7, 9, 30], 5)] == [first]
    assert len([s.token for s in gen.greedy([1, 7, 9, 30], 5, stop_at_eos=False)]) == 5


def test_bad_arguments_exit_2(capsys, tmp_path):
    assert main([str(TINY_PAGED), "--prompt-ids", "1,2", "--max-new-tokens", "0"]) == 2
    assert main([str(tmp_path), "--prompt-ids", "1,2"]) == 2
    assert "genai_config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([str(TINY_PAGED), "--prompt-ids", "1,x"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        main([str(TINY_PAGED)])  # a prompt is required
    assert main([str(TINY_PAGED), "--prompt-ids", "1,2", "--max-new-tokens", "500"]) == 2  # beyond context 128


def test_prompt_text_needs_the_tokenizer(capsys):
    assert main([str(TINY_PAGED), "--prompt", "hello"]) == 2
    err = capsys.readouterr().err
    assert "--prompt needs" in err and "tokenizer.json" in err


def test_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "pagedkit.apps.run.cli", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--parity" in proc.stdout and "paged-run" in proc.stdout


# ---- parity with Hugging Face on builder models -------------------------------------------------------

@pytest.fixture(scope="module")
def builder(tmp_path_factory):
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("transformers")
    from test_genai_run import build, shared_root, write_checkpoint

    root = shared_root(tmp_path_factory)

    def get(layout: str) -> tuple[Path, Path]:
        return build(root, "llama", layout)

    other = root / "hf-llama-other-seed"
    if not (other / "config.json").exists():
        write_checkpoint("llama", other, seed=1)
    return get, other


def _table(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, l in enumerate(lines) if l.lstrip().startswith("step"))
    return [l for l in lines[start + 1:] if re.match(r"\s*\d+\s", l)]


@pytest.mark.parametrize("layout", ["paged", "gqa"])
def test_parity_with_hf(builder, layout, capsys):
    get, _ = builder
    model_dir, hf_dir = get(layout)
    args = [str(model_dir), "--prompt", "t5 t9 t33 t70 t4 t101", "--max-new-tokens", "8", "--parity", str(hf_dir),
            "--ignore-eos"]
    if layout == "paged":
        args += ["--block-size", "16"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "prompt: 6 tokens [5, 9, 33, 70, 4, 101]" in out  # word-level tokenizer of the folder
    rows = _table(out)
    assert len(rows) == 8
    for row in rows:
        assert "agree" in row or "near-tie" in row, row
        assert "> tol" not in row and "DIFFER" not in row, row
    tol = "0.02" if layout == "paged" else "0.0001"
    assert re.search(rf"parity OK: largest max\|diff\| / max\|ref\| = \S+ \(tol {tol}\)", out), out
    text = out.splitlines()[2]  # streamed text: the tokenizer's words
    assert all(w.startswith("t") or w in ("<s>", "</s>", "<unk>") for w in text.split())
    hf_tokens = [int(r.split()[3]) for r in rows]
    ours = _ids(out)
    assert [o for o, h, r in zip(ours, hf_tokens, rows) if o != h and "near-tie" not in r] == []


def test_lite_is_the_cpu_default(builder, capsys):
    """On the CPU, paged-run runs a paged model through runtime/lite (no torch in its session's path) with
    --parity OK, and the same tokens as the onnxruntime backend under pagedkit's session; --cpu-backend lite on a
    model lite does not serve exits 2 with the reason on one line."""
    get, _ = builder
    model_dir, hf_dir = get("paged")
    args = [str(model_dir), "--prompt-ids", "5,9,33,70,4,101", "--max-new-tokens", "8", "--ignore-eos"]
    assert main(args + ["--parity", str(hf_dir)]) == 0
    out = capsys.readouterr().out
    assert "runtime/lite" in out and "parity OK" in out and len(_table(out)) == 8
    assert main(args + ["--cpu-backend", "onnxruntime"]) == 0
    other = capsys.readouterr().out
    assert "runtime/lite" not in other and _ids(other) == _ids(out)
    gqa, _ = get("gqa")
    assert main([str(gqa), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--cpu-backend", "lite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cpu-backend lite" in err[0] and "GQA-layout" in err[0]


def test_parity_failure_exits_1(builder, capsys):
    get, other = builder
    model_dir, _ = get("gqa")
    assert main([str(model_dir), "--prompt-ids", "1,5,9", "--max-new-tokens", "3", "--parity", str(other)]) == 1
    out = capsys.readouterr().out
    assert "parity FAIL" in out and "> tol" in out
    assert main([str(model_dir), "--prompt-ids", "1,5", "--max-new-tokens", "2", "--parity",
                 str(other / "missing")]) == 2


def test_docs_examples_run(monkeypatch, capsys):
    """Every python block of docs/runtime.md runs as written (from the repository root), and the documented
    paged-run output of examples/tiny-paged is what the command prints."""
    monkeypatch.chdir(ROOT)
    doc = (ROOT / "docs" / "runtime.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) >= 3
    for block in blocks:
        exec(compile(block, "docs/runtime.md", "exec"), {})
    capsys.readouterr()
    assert main(["examples/tiny-paged", "--prompt-ids", "1,7,9", "--max-new-tokens", "5", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    documented = re.search(r"\$ paged-run examples/tiny-paged .*?\n(.*?)```", doc, re.S).group(1).splitlines()
    assert out.splitlines()[1:4] == documented[1:4]  # prompt, streamed tokens, ids (timings vary)


@pytest.mark.gpu
def test_cuda_generation_matches_cpu(capsys):
    cpu, gpu = Generator(TINY_PAGED), Generator(TINY_PAGED, device="cuda")
    assert gpu.session.device.type == "cuda" and gpu.state.mgr.device.type == "cuda"
    a = cpu.teacher_forced([1, 7, 9, 30], [5, 6, 7, 8, 9])
    b = gpu.teacher_forced([1, 7, 9, 30], [5, 6, 7, 8, 9])
    for x, y in zip(a, b):
        assert (x.logits - y.logits).abs().max() <= 2e-3 * x.logits.abs().max()
    assert main([str(TINY_PAGED), "--prompt-ids", "1,7,9", "--max-new-tokens", "4", "--device", "cuda"]) == 0
    assert "on cuda" in capsys.readouterr().out


def test_pagedkit_exported_model_runs_with_parity(tmp_path, capsys):
    """A model of pagedkit's own exporter (genai_config with the pagedkit section; Gemma 2 with a windowed
    layer served from a ring, prompt longer than the window) generates with --parity OK."""
    pytest.importorskip("transformers")
    from export_utils import export_tiny, tiny_model

    hf = tiny_model("Gemma2Config", sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                    query_pre_attn_scalar=16)
    hf.save_pretrained(tmp_path / "hf")
    export_tiny(hf, tmp_path / "onnx")
    prompt = ",".join(str(3 + (i * 7) % 130) for i in range(30))
    assert main([str(tmp_path / "onnx"), "--prompt-ids", prompt, "--max-new-tokens", "6", "--parity",
                 str(tmp_path / "hf"), "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert len(_table(out)) == 6 and "parity OK" in out
