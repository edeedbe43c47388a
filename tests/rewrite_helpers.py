"""Run genai-layout decoders step by step for the rewriter tests (teacher-forced, same tokens both sides).

- `run_gqa(sess, prompt, steps)`: a GQA-layout model (onnxruntime or pagedkit session), batch of one: the
  prompt, then one token per step; returns the logits of every token [len(prompt) + steps, V] (float64).
- `run_paged(sess, prompts, steps, block_size, seed)`: a paged-layout model; every sequence of `prompts` in
  ONE packed batch (a ragged prefill, then one token per sequence per step) over a shuffled block table;
  returns one [len(prompt_b) + steps, V] array per sequence.
The tokens fed after the prompt are fixed (`forced`), not sampled, so both sides see the same inputs.
"""

from __future__ import annotations

import numpy as np

from pagedkit.interface import names as N


def forced(prompt: list[int], steps: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed + len(prompt))
    return [int(t) for t in rng.integers(3, vocab, steps)]


def _inputs(sess) -> dict:
    return {i.name: i for i in sess.get_inputs()}


def _np_dtype(type_str: str):
    return {"tensor(float16)": np.float16, "tensor(float)": np.float32, "tensor(bfloat16)": np.float32,
            "tensor(int64)": np.int64, "tensor(int32)": np.int32}[type_str]


def run_gqa(sess, prompt: list[int], steps: int, vocab: int, seed: int = 0, head_size: int = 16,
            window: int = 32) -> np.ndarray:
    ins = _inputs(sess)
    layers = sorted(int(n.split(".")[1]) for n in ins if n.startswith("past_key_values.") and n.endswith(".key"))
    kv = ins[N.past_name("key", layers[0])]
    hkv, d = kv.shape[1], kv.shape[3] if isinstance(kv.shape[3], int) else head_size
    cdt = _np_dtype(kv.type)
    # windowed layers (sliding_window_cache=1, dim 'past_sliding_length') keep a fixed window-sized buffer
    sliding = {i for i in layers if ins[N.past_name("key", i)].shape[2] == "past_sliding_length"}
    past = {N.past_name(k, i): np.zeros((1, hkv, window if i in sliding else 0, d), cdt)
            for i in layers for k in ("key", "value")}
    tokens = list(prompt)
    out = []
    feed_ids = list(prompt)
    for step in range(steps + 1):
        total = len(tokens)
        feeds = {N.INPUT_IDS: np.array([feed_ids], np.int64),
                 N.ATTENTION_MASK: np.ones((1, total), np.int64), **past}
        names = [N.LOGITS] + [N.present_name(k, i) for i in layers for k in ("key", "value")]
        res = dict(zip(names, sess.run(names, feeds)))
        out.append(np.asarray(res[N.LOGITS], np.float64)[0])
        past = {N.past_name(k, i): res[N.present_name(k, i)] for i in layers for k in ("key", "value")}
        if step < steps:
            nxt = forced(prompt, steps, vocab, seed)[step]
            tokens.append(nxt)
            feed_ids = [nxt]
    return np.concatenate(out, 0)


def run_paged(sess, prompts: list[list[int]], steps: int, vocab: int, block_size: int = 16, seed: int = 0,
              windowed: bool = False) -> list[np.ndarray]:
    ins = _inputs(sess)
    layers = sorted(int(n.split(".")[1]) for n in ins if n.startswith("past_key_values.") and n.endswith(".key"))
    kv = ins[N.past_name("key", layers[0])]
    hkv, d = kv.shape[2], kv.shape[3]
    cdt = _np_dtype(kv.type)
    bsz = len(prompts)
    longest = max(len(p) for p in prompts) + steps
    per_seq = -(-longest // block_size)
    num_blocks = bsz * per_seq + 3
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks)[: bsz * per_seq]
    table = perm.reshape(bsz, per_seq).astype(np.int32)
    caches = {N.past_name(k, i): np.full((num_blocks, block_size, hkv, d), np.nan, cdt)
              for i in layers for k in ("key", "value")}
    lengths = [0] * bsz
    outs: list[list[np.ndarray]] = [[] for _ in range(bsz)]
    step_tokens = [list(p) for p in prompts]
    follow = [forced(p, steps, vocab, seed) for p in prompts]
    for step in range(steps + 1):
        ids = [t for seq in step_tokens for t in seq]
        csl = np.cumsum([0] + [len(s) for s in step_tokens]).astype(np.int32)
        feeds = {N.INPUT_IDS: np.array(ids, np.int64), N.BLOCK_TABLE: table,
                 N.CUMULATIVE_SEQUENCE_LENGTHS: csl, N.PAST_SEQUENCE_LENGTHS: np.array(lengths, np.int32),
                 N.ATTENTION_METADATA: np.array([max(len(s) for s in step_tokens), max(lengths) +
                                                 max(len(s) for s in step_tokens), 0], np.int32), **caches}
        if N.BLOCK_TABLE_WINDOWED in ins:
            feeds[N.BLOCK_TABLE_WINDOWED] = table
        names = [N.LOGITS] + [N.present_name(k, i) for i in layers for k in ("key", "value")]
        res = dict(zip(names, sess.run(names, feeds)))
        logits = np.asarray(res[N.LOGITS], np.float64)
        for b in range(bsz):
            outs[b].append(logits[csl[b]:csl[b + 1]])
            lengths[b] += len(step_tokens[b])
        caches = {N.past_name(k, i): np.asarray(res[N.present_name(k, i)]) for i in layers for k in ("key", "value")}
        if step < steps:
            step_tokens = [[follow[b][step]] for b in range(bsz)]
    return [np.concatenate(o, 0) for o in outs]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    """max |a - ref| / max |ref| (norm-relative)."""
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-12))


def save_sharp_checkpoint(family: str, out, factor: float = 10.0, seed: int = 0):
    """tests/genai_models.save_checkpoint with every layer's q_proj and k_proj weights multiplied by `factor`:
    a random init's attention scores are ~0.03 (softmax nearly uniform, logits blind to the score scale);
    x10 on Q and K makes them O(1), so a 2% scale error moves the logits well past the fp16 tolerance."""
    import torch
    import transformers

    from genai_models import _COMMON, FAMILIES, _save_tokenizer

    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**(_COMMON | extra))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(factor)
            layer.self_attn.k_proj.weight.mul_(factor)
    model.save_pretrained(out)
    _save_tokenizer(out, config.vocab_size)
    return out


def build_sharp_model(family: str, layout: str, root):
    """The builder's model folder for the sharpened checkpoint of `family` in `layout` ("gqa" / "paged"),
    built once under root. Raises genai_models.BuilderFailed."""
    from pathlib import Path

    from genai_models import BuilderFailed, run_builder

    root = Path(root)
    out = root / f"{family}-sharp-{layout}"
    if (out / "model.onnx").exists():
        return out
    hf = root / f"hf-{family}-sharp"
    if not (hf / "config.json").exists():
        try:
            save_sharp_checkpoint(family, hf)
        except Exception as exc:
            raise BuilderFailed(f"could not write a {family} checkpoint: {type(exc).__name__}: {exc}") from exc
    return run_builder(hf, out, layout, root / "cache")


def build_sharp_models(pairs, root) -> list[str]:
    """build_sharp_model for every (family, layout) of `pairs` not built yet under root, in one builder process
    (genai_models.prebuild); returns the reasons of what could not be built."""
    from functools import partial
    from pathlib import Path

    from genai_models import prebuild

    root = Path(root)
    return prebuild([(root / f"hf-{family}-sharp", partial(save_sharp_checkpoint, family),
                      root / f"{family}-sharp-{layout}", layout) for family, layout in pairs], root / "cache")


def greedy_paged(sess, prompt: list[int], new: int, block_size: int = 16, seed: int = 0) -> list[int]:
    """Greedy generation of `new` tokens with a paged-layout model (one sequence, shuffled block table)."""
    ins = _inputs(sess)
    layers = sorted(int(n.split(".")[1]) for n in ins if n.startswith("past_key_values.") and n.endswith(".key"))
    kv = ins[N.past_name("key", layers[0])]
    hkv, d = kv.shape[2], kv.shape[3]
    blocks = -(-(len(prompt) + new) // block_size)
    table = np.random.default_rng(seed).permutation(blocks + 3)[:blocks].astype(np.int32)[None]
    caches = {N.past_name(k, i): np.zeros((blocks + 3, block_size, hkv, d), _np_dtype(kv.type))
              for i in layers for k in ("key", "value")}
    names = [N.LOGITS] + [N.present_name(k, i) for i in layers for k in ("key", "value")]
    past, feed, out = 0, list(prompt), []
    for _ in range(new):
        feeds = {N.INPUT_IDS: np.array(feed, np.int64), N.BLOCK_TABLE: table,
                 N.CUMULATIVE_SEQUENCE_LENGTHS: np.array([0, len(feed)], np.int32),
                 N.PAST_SEQUENCE_LENGTHS: np.array([past], np.int32),
                 N.ATTENTION_METADATA: np.array([len(feed), past + len(feed), 0], np.int32), **caches}
        if N.BLOCK_TABLE_WINDOWED in ins:
            feeds[N.BLOCK_TABLE_WINDOWED] = table
        res = dict(zip(names, sess.run(names, feeds)))
        nxt = int(np.asarray(res[N.LOGITS], np.float64)[-1].argmax())
        out.append(nxt)
        caches = {N.past_name(k, i): np.asarray(res[N.present_name(k, i)]) for i in layers for k in ("key", "value")}
        past += len(feed)
        feed = [nxt]
    return out


def og_greedy(folder, prompt: list[int], new: int) -> list[int]:
    """onnxruntime-genai (og.Model on the CPU) greedy continuation of `prompt`: the `new` generated tokens."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([prompt], dtype=np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(prompt):]
