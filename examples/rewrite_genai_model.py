"""Rewrite an onnxruntime-genai GQA model to PagedAttention, run both, compare.

    python examples/rewrite_genai_model.py                 # builds a tiny random Llama with the builder
    python examples/rewrite_genai_model.py GQA_FOLDER      # or takes a builder GQA folder (model.onnx +
                                                           # genai_config.json), e.g. `-p fp32 -e cpu`

Steps: (1) without a folder, write a tiny random Llama checkpoint and run onnxruntime-genai's builder on it
(`-p fp32 -e cpu`, GroupQueryAttention); (2) `rewrite_file(..., to="paged")` writes the PagedAttention
model and its genai_config.json; (3) the original runs in onnxruntime CPU, the rewrite in
pagedkit.InferenceSession, on the same prompt, greedy, 16 new tokens each, with the original's tokens fed
to both (teacher-forced) so their logits are comparable at every step; (4) prints the largest logit
difference relative to the largest logit, and both generated token lists.
Needs: onnxruntime, onnxruntime-genai and transformers (for building; not with a folder).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # genai_models: the builder helper the tests use


def build_tiny_llama(root: Path) -> Path:
    from genai_models import build_genai_model

    return build_genai_model("llama", "gqa", root)


def greedy_gqa(sess, prompt: list[int], new: int, head_size: int, window: int = 0
               ) -> tuple[list[int], list[np.ndarray]]:
    """onnxruntime on the GQA layout: prompt, then greedy tokens; returns (tokens, logits of each step's last
    token). Windowed layers (dim 'past_sliding_length', sliding_window_cache=1) get a window-sized buffer."""
    ins = {i.name: i for i in sess.get_inputs()}
    layers = sorted({int(n.split(".")[1]) for n in ins if n.startswith("past_key_values.")})
    hkv = ins["past_key_values.0.key"].shape[1]
    past = {f"past_key_values.{i}.{k}": np.zeros(
        (1, hkv, window if ins[f"past_key_values.{i}.key"].shape[2] == "past_sliding_length" else 0, head_size),
        np.float32) for i in layers for k in ("key", "value")}
    tokens, feed, outs = list(prompt), list(prompt), []
    for _ in range(new):
        names = ["logits"] + [f"present.{i}.{k}" for i in layers for k in ("key", "value")]
        res = sess.run(names, {"input_ids": np.array([feed], np.int64),
                               "attention_mask": np.ones((1, len(tokens)), np.int64), **past})
        logits = res[0][0, -1].astype(np.float64)
        outs.append(logits)
        past = {n.replace("present.", "past_key_values."): v for n, v in zip(names[1:], res[1:])}
        nxt = int(logits.argmax())
        tokens.append(nxt)
        feed = [nxt]
    return tokens[len(prompt):], outs


def forced_paged(sess, prompt: list[int], forced: list[int], block_size: int = 16, seed: int = 0
                 ) -> tuple[list[int], list[np.ndarray]]:
    """pagedkit on the paged layout, fed the prompt then `forced` tokens, over a shuffled block table;
    returns (its own greedy choice at each step, logits of each step's last token)."""
    ins = {i.name: i for i in sess.get_inputs()}
    layers = sorted({int(n.split(".")[1]) for n in ins if n.startswith("past_key_values.")})
    _, _, hkv, head = ins["past_key_values.0.key"].shape
    blocks = -(-(len(prompt) + len(forced)) // block_size)
    rng = np.random.default_rng(seed)
    table = rng.permutation(blocks + 4)[:blocks].astype(np.int32)[None]
    caches = {f"past_key_values.{i}.{k}": np.zeros((blocks + 4, block_size, hkv, head), np.float16)
              for i in layers for k in ("key", "value")}
    past, feed, choices, outs = 0, list(prompt), [], []
    for step in range(len(forced)):
        names = ["logits"] + [f"present.{i}.{k}" for i in layers for k in ("key", "value")]
        feeds = {"input_ids": np.array(feed, np.int64), "block_table": table,
                 "cumulative_sequence_lengths": np.array([0, len(feed)], np.int32),
                 "past_sequence_lengths": np.array([past], np.int32),
                 "attention_metadata": np.array([len(feed), past + len(feed), 0], np.int32), **caches}
        if "block_table_windowed" in ins:  # windowed layers: the same (full-length) table suffices
            feeds["block_table_windowed"] = table
        res = sess.run(names, feeds)
        logits = np.asarray(res[0][-1], np.float64)
        outs.append(logits)
        choices.append(int(logits.argmax()))
        caches = {n.replace("present.", "past_key_values."): np.asarray(v) for n, v in zip(names[1:], res[1:])}
        past += len(feed)
        feed = [forced[step]]
    return choices, outs


def main(argv: list[str]) -> int:
    import onnxruntime as ort

    import pagedkit
    from pagedkit.interface import read_genai_config
    from pagedkit.rewriters.rewrite import rewrite_file

    work = Path(tempfile.mkdtemp(prefix="rewrite-example-"))
    src = Path(argv[0]) if argv else build_tiny_llama(work)
    out = work / "paged" / "model.onnx"
    report = rewrite_file(src, out, "paged")
    print(report)
    prompt = [1, 17, 33, 52, 8, 90, 11]
    folder = src if src.is_dir() else src.parent
    decoder = read_genai_config(folder)["model"]["decoder"]
    window = decoder.get("sliding_window", {}).get("window_size", 0)
    original = ort.InferenceSession(str(src / "model.onnx" if src.is_dir() else src),
                                    providers=["CPUExecutionProvider"])
    ref_tokens, ref_logits = greedy_gqa(original, prompt, 16, decoder["head_size"], window)
    choices, logits = forced_paged(pagedkit.InferenceSession(str(out)), prompt, ref_tokens)
    diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, ref_logits))
    scale = max(float(np.abs(b).max()) for b in ref_logits)
    print(f"largest logit difference: {diff:.3g} ({diff / scale:.2e} of the largest logit)")
    print(f"onnxruntime (GQA):        {ref_tokens}")
    print(f"pagedkit (PagedAttention): {choices}")
    same = sum(a == b for a, b in zip(ref_tokens, choices))
    print(f"same greedy token at {same} of {len(ref_tokens)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
