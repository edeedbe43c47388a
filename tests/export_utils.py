"""Shared harness of the exporter tests: tiny random Hugging Face models, export, and parity runs.

`check_parity(hf_model, model_dir)` runs the exported model with pagedkit's InferenceSession over a
batch of two sequences of different prompt lengths whose blocks are scattered over a shuffled pool
(non-contiguous, out of order; windowed layers read a ring table `block_table_windowed` whose block ids
repeat), prefill then decode steps, and compares the logits with Hugging Face eager (float32) on the
same token sequences: max|diff| <= tol * max|ref| per step. The decode tokens are Hugging Face's own
greedy choices (teacher forcing), so the greedy comparison needs no generation loop of ours: each step
our argmax must equal HF's, except where HF's top-2 gap is a near-tie (reported).

Caches are poisoned with large random values before the first write: a kernel that reads an
unwritten slot or a block of another sequence changes the logits visibly.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

TOL = 2e-2  # max|diff| <= TOL * max|ref| (fp16 graph vs fp32 reference)
NEAR_TIE = 2e-2  # an HF top-1/top-2 logit gap below NEAR_TIE * max|ref| of the step is a near-tie
# bf16 graph vs its own checkpoint (the HF model with every weight rounded to bf16, run in float32:
# `bf16_weights`): 0.08 = 20 bf16 unit roundoffs (2^-8). Measured on the tiny models of these tests over
# 16 decode steps: a correct bf16 export reaches 0.030 (Llama) and 0.048 (DeepSeek-V2); a 5% wrong
# attention scale 0.10-0.14 (tests/test_export_llama.py, test_export_deepseek.py: the teeth). The older
# bound, 8 x TOL = 0.16 against HF float32 weights, passed a 5% scale error (0.12).
BF16_TOL = 8e-2

TINY = dict(vocab_size=144, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)


def tiny_model(config_cls: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random float32 HF causal LM (eager attention) with non-trivial norm gains and biases."""
    import transformers

    config = getattr(transformers, config_cls)(**(TINY | overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm gains (around 1) and biases / sinks (around 0): never all-equal
                base = 1.0 if "norm" in name and not getattr(config, "model_type", "").startswith("gemma") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=gen))
            else:  # larger weights than HF's init (std 0.02) so that logits and attention are far from flat
                p.copy_(torch.randn(p.shape, generator=gen) * (1.5 / math.sqrt(p.shape[-1])))
    return model


def bf16_weights(hf_model) -> torch.nn.Module:
    """A copy of `hf_model` with every parameter rounded to bfloat16 and kept in float32: the checkpoint a
    bf16 export holds, run without bf16 activation rounding (the reference of the bf16 parity tests)."""
    import copy

    ref = copy.deepcopy(hf_model)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return ref


def export_tiny(hf_model, out_dir: Path, **opts):
    from pagedkit.exporters.export import export_hf_model
    from pagedkit.exporters.families.base import ExportOptions

    opts.setdefault("progress", False)
    return export_hf_model(hf_model, out_dir, ExportOptions(**opts))


def _session(model_dir: Path):
    try:
        from pagedkit import InferenceSession
    except ImportError:
        from pagedkit.runtime.session import InferenceSession
    return InferenceSession(str(Path(model_dir) / "model.onnx"))


@dataclass
class _Pool:
    """A tiny block allocator: a shuffled free list (so block ids are out of order and non-contiguous)."""

    num_blocks: int
    rng: random.Random
    free: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.free = list(range(self.num_blocks))
        self.rng.shuffle(self.free)

    def take(self) -> int:
        return self.free.pop()


@dataclass
class _Seq:
    tokens: list[int]  # all tokens known (prompt + teacher-forced continuation)
    length: int = 0  # tokens already in the cache
    blocks: list[int] = field(default_factory=list)  # full-attention blocks, by logical index
    ring: list[int] = field(default_factory=list)  # windowed ring blocks


class PagedRunner:
    """Feeds an exported model step by step, building block tables / lengths the way an engine does."""

    def __init__(self, model_dir: Path, block_size: int = 16, num_blocks: int = 24, ring_blocks: int = 3,
                 seed: int = 0, session=None):
        from pagedkit.exporters.config import read_pagedkit_section

        self.sess = session if session is not None else _session(model_dir)
        self.section = read_pagedkit_section(Path(model_dir))
        self.bs, self.ring_blocks = block_size, ring_blocks
        self.rng = random.Random(seed)
        self.pool = _Pool(num_blocks, self.rng)
        nb_win = 2 * ring_blocks + 3
        self.win_pool = _Pool(nb_win, self.rng)
        gen = torch.Generator().manual_seed(seed)
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.caches: dict[str, torch.Tensor] = {}
        for name, info in self.inputs.items():
            if not name.startswith("past_key_values."):
                continue
            dims = list(info.shape)
            dims[0] = nb_win if dims[0] == "num_blocks_windowed" else num_blocks
            dims[1] = block_size
            dtype = {"tensor(float16)": torch.float16, "tensor(bfloat16)": torch.bfloat16,
                     "tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8,
                     "tensor(float8e4m3fn)": torch.float8_e4m3fn, "tensor(float)": torch.float32}[info.type]
            if dtype.is_floating_point:  # poison: large finite values
                t = (torch.randn(dims, generator=gen) * 50).to(dtype)
                if name.endswith("_scale"):
                    t = t.abs() + 1
            else:
                t = torch.randint(-128 if dtype == torch.int8 else 0, 128, dims, generator=gen).to(dtype)
            self.caches[name] = t
        self.windowed = "block_table_windowed" in self.inputs

    def _reserve(self, s: _Seq, upto: int) -> None:
        while len(s.blocks) * self.bs < upto:
            s.blocks.append(self.pool.take())
        if self.windowed and not s.ring:
            s.ring = [self.win_pool.take() for _ in range(self.ring_blocks)]

    def step(self, seqs: list[_Seq], counts: list[int]) -> list[np.ndarray | None]:
        """Run one step: seq b gets its next counts[b] tokens (sequences with 0 sit the step out);
        returns each sequence's logits [n_b, V] (None for those that sat out)."""
        active = [(s, n) for s, n in zip(seqs, counts) if n > 0]
        ids, csl, past = [], [0], []
        for s, n in active:
            self._reserve(s, s.length + n)
            ids += s.tokens[s.length:s.length + n]
            csl.append(csl[-1] + n)
            past.append(s.length)
        width = max(len(s.blocks) for s, _ in active) + 1  # one spare column: entries beyond the extent
        table = np.full((len(active), width), -1, np.int32)
        wtable = np.full((len(active), width), -1, np.int32)
        for b, (s, _) in enumerate(active):
            table[b, :len(s.blocks)] = s.blocks
            if self.windowed:  # ring: logical block j -> ring[j % N], indexed by absolute position
                wtable[b, :len(s.blocks)] = [s.ring[j % len(s.ring)] for j in range(len(s.blocks))]
        feeds = {
            "input_ids": torch.tensor(ids, dtype=torch.int64),
            "block_table": torch.from_numpy(table),
            "cumulative_sequence_lengths": torch.tensor(csl, dtype=torch.int32),
            "past_sequence_lengths": torch.tensor(past, dtype=torch.int32),
            "attention_metadata": torch.tensor([max(n for _, n in active),
                                                max(s.length + n for s, n in active), 0], dtype=torch.int32),
            **self.caches,
        }
        if self.windowed:
            feeds["block_table_windowed"] = torch.from_numpy(wtable)
        positions = [p for s, n in active for p in range(s.length, s.length + n)]
        if "slot_mapping" in self.inputs:  # the slot each new token's K/V goes to
            slots = [s.blocks[p // self.bs] * self.bs + p % self.bs for s, n in active
                     for p in range(s.length, s.length + n)]
            feeds["slot_mapping"] = torch.tensor(slots, dtype=torch.int32)
        if "query_positions" in self.inputs:
            feeds["query_positions"] = torch.tensor(positions, dtype=torch.int32)
        outs = self.sess.run_torch(feeds)
        for name in self.caches:  # present.{i}.* alias past_key_values.{i}.* (updated in place)
            self.caches[name] = outs[name.replace("past_key_values.", "present.")]
        logits = outs["logits"].float().cpu().numpy()
        result, b = [], 0
        for s, n in zip(seqs, counts):
            if n > 0:
                result.append(logits[csl[b]:csl[b + 1]])
                s.length += n
                b += 1
            else:
                result.append(None)
        return result


@torch.no_grad()
def hf_greedy_sequence(hf_model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """HF's greedy continuation of `prompt` (steps tokens) and HF's logits at every position."""
    ids = list(prompt)
    for _ in range(steps):
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    full = hf_model(torch.tensor([ids])).logits[0].float().numpy()
    return ids, full


@dataclass
class ParityReport:
    worst_ratio: float  # max over steps of max|diff| / max|ref|
    near_ties: list[tuple[int, int, int, float]]  # (sequence, step, position, gap) where argmax differed
    mismatches: list[tuple[int, int, int, float]]  # argmax differences that are not near-ties
    steps: int


def check_parity(hf_model, model_dir: Path, *, prompt_lens=(11, 37), chunk: int | None = None,
                 steps: int = 16, seed: int = 0, block_size: int = 16, tol: float = TOL,
                 ring_blocks: int = 3, greedy: bool = True, near_tie: float = NEAR_TIE, session=None,
                 reference: dict | None = None) -> ParityReport:
    """Prefill (one shot, or chunked by `chunk`) + `steps` teacher-forced decode steps through the
    exported model vs HF eager; asserts the tolerance at every step (prefill included) and greedy
    agreement (near-ties, HF top-2 gaps below near_tie * max|ref|, reported, not failed).
    session: run this session object (get_inputs / run_torch) instead of pagedkit's on model_dir.
    reference: a dict memoizing HF's sequences and logits per (prompt, steps) across calls on the same,
    unchanged model (the family tests run one model through several exports)."""
    rng = np.random.default_rng(seed)
    vocab = hf_model.config.vocab_size
    seqs, refs = [], []
    for n in prompt_lens:
        prompt = [int(t) for t in rng.integers(3, vocab, n)]
        key = (tuple(prompt), steps)
        if reference is None or key not in reference:
            got = hf_greedy_sequence(hf_model, prompt, steps)
            if reference is None:
                ids, ref = got
            else:
                reference[key] = got
        if reference is not None:
            ids, ref = reference[key]
        seqs.append(_Seq(list(ids)))
        refs.append(ref)
    runner = PagedRunner(model_dir, block_size=block_size, seed=seed, ring_blocks=ring_blocks, session=session)
    worst, ties, bad = 0.0, [], []

    def compare(b: int, step: int, got: np.ndarray, first: int):
        nonlocal worst
        ref = refs[b][first:first + got.shape[0]]
        scale = float(np.abs(ref).max())
        ratio = float(np.abs(got - ref).max()) / scale
        assert np.isfinite(got).all(), f"sequence {b} step {step}: non-finite logits"
        worst = max(worst, ratio)
        assert ratio <= tol, (f"sequence {b} step {step}: max|diff| = {ratio:.3g} x max|ref| > {tol} "
                              f"(positions {first}..{first + got.shape[0] - 1})")
        for j in range(got.shape[0]):
            top = np.sort(ref[j])[-2:]
            if int(got[j].argmax()) != int(ref[j].argmax()):
                gap = float(top[1] - top[0])
                (ties if gap < near_tie * scale else bad).append((b, step, first + j, gap / scale))

    # prefill, in chunks of at most `chunk` tokens per sequence (None: one shot)
    while any(s.length < n for s, n in zip(seqs, prompt_lens)):
        firsts = [s.length for s in seqs]
        counts = [min(n - s.length, chunk or n) for s, n in zip(seqs, prompt_lens)]
        for b, o in enumerate(runner.step(seqs, counts)):
            if o is not None:
                compare(b, 0, o, firsts[b])
    for step in range(1, steps + 1):
        firsts = [s.length for s in seqs]
        outs = runner.step(seqs, [1] * len(seqs))
        for b, o in enumerate(outs):  # every sequence decodes: o is never None
            compare(b, step, o, firsts[b])
    assert not (greedy and bad), f"greedy argmax differs from HF beyond near-ties at (seq, step, pos, gap/max): {bad}"
    return ParityReport(worst, ties, bad, steps)


def io_signature(model_path: Path) -> dict[str, tuple[str, int, str]]:
    """{name: (kind, elem_type, rank)} of a model's graph inputs and outputs."""
    import onnx

    m = onnx.load(str(model_path), load_external_data=False)
    inits = {i.name for i in m.graph.initializer}
    sig = {}
    for kind, vis in (("input", m.graph.input), ("output", m.graph.output)):
        for vi in vis:
            if vi.name in inits:
                continue
            tt = vi.type.tensor_type
            sig[vi.name] = (kind, tt.elem_type, len(tt.shape.dim))
    return sig


def assert_valid_export(model_dir: Path) -> None:
    """pagedkit's validator clean, onnx.checker (full_check) clean, onnxruntime-genai's Config accepts it."""
    import onnx

    from pagedkit.validators import validate_model

    model_dir = Path(model_dir)
    issues = validate_model(str(model_dir))
    assert issues == [], "\n".join(map(str, issues))
    onnx.checker.check_model(str(model_dir / "model.onnx"), full_check=True)
    try:
        import onnxruntime_genai as og
    except ImportError:  # optional: the genai parser check needs onnxruntime-genai
        return
    og.Config(str(model_dir))


def attention_attrs(model_path: Path) -> list[dict]:
    """Attributes (with the inputs by contract name) of every PagedAttention node, in graph order."""
    import onnx

    from pagedkit.validators import PAGED_ATTENTION

    m = onnx.load(str(model_path), load_external_data=False)
    out = []
    for n in m.graph.node:
        if n.op_type == "PagedAttention":
            d = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            d = {k: v.decode() if isinstance(v, bytes) else v for k, v in d.items()}
            d["inputs"] = {PAGED_ATTENTION.inputs[i].name: t for i, t in enumerate(n.input) if t}
            out.append(d)
    return out


def save_tiny_checkpoint(hf_model, out_dir: Path) -> Path:
    """save_pretrained (safetensors) + a local word-level tokenizer (no hub), for the CLI / builder paths."""
    from genai_models import _save_tokenizer

    hf_model.save_pretrained(out_dir)
    _save_tokenizer(Path(out_dir), hf_model.config.vocab_size)
    return Path(out_dir)


def run_tokens(model_dir: Path, token_lists: list[list[int]], prompt_lens, *, chunk: int | None = None,
               seed: int = 0) -> list[np.ndarray]:
    """Logits [len, V] of every position of each token list: prefill prompt_lens[b] tokens (chunked by
    `chunk`), then one token per step (teacher forcing) through a PagedRunner."""
    runner = PagedRunner(model_dir, seed=seed)
    seqs = [_Seq(list(t)) for t in token_lists]
    got = [[] for _ in seqs]
    while any(s.length < n for s, n in zip(seqs, prompt_lens)):
        counts = [min(n - s.length, chunk or n) for s, n in zip(seqs, prompt_lens)]
        for b, o in enumerate(runner.step(seqs, counts)):
            if o is not None:
                got[b].append(o)
    while any(s.length < len(s.tokens) for s in seqs):
        counts = [1 if s.length < len(s.tokens) else 0 for s in seqs]
        for b, o in enumerate(runner.step(seqs, counts)):
            if o is not None:
                got[b].append(o)
    return [np.concatenate(g) for g in got]


def assert_close_logits(got: list[np.ndarray], ref: list[np.ndarray], tol: float = TOL, what: str = "") -> float:
    """max|diff| <= tol * max|ref| per sequence; returns the worst ratio."""
    worst = 0.0
    for b, (g, r) in enumerate(zip(got, ref)):
        assert g.shape == r.shape and np.isfinite(g).all()
        ratio = float(np.abs(g - r).max() / np.abs(r).max())
        worst = max(worst, ratio)
        assert ratio <= tol, f"{what} sequence {b}: max|diff| = {ratio:.3g} x max|ref| > {tol}"
    return worst


def mutated_export(src: Path, dst: Path, *, drop: tuple = (), window: int | None = None, **attrs) -> Path:
    """A copy of an export with `attrs` overwritten on every PagedAttention node, `window` replacing
    local_window_size on the windowed nodes only, and the inputs named in `drop` (contract names) removed:
    the parity check's teeth. External data is copied once (links are refused by onnx and the runtime)."""
    import shutil

    import onnx

    from pagedkit.validators.contract import get_contract

    names = get_contract("PagedAttention").input_names
    src, dst = Path(src), Path(dst)
    m = onnx.load(str(src / "model.onnx"), load_external_data=False)
    for n in m.graph.node:
        if n.op_type != "PagedAttention":
            continue
        for k, v in attrs.items():
            for a in list(n.attribute):
                if a.name == k:
                    n.attribute.remove(a)
            n.attribute.append(onnx.helper.make_attribute(k, v))
        for a in n.attribute:
            if window is not None and a.name == "local_window_size" and a.i > 0:
                a.i = window
        for name in drop:
            i = names.index(name)
            assert i < len(n.input) and n.input[i], f"{n.name} has no input {name!r} to drop"
            n.input[i] = ""
    dst.mkdir(exist_ok=True)
    onnx.save(m, str(dst / "model.onnx"))
    data = src / "model.onnx.data"
    if data.exists() and not (dst / data.name).exists():
        shutil.copyfile(data, dst / data.name)
    shutil.copyfile(src / "genai_config.json", dst / "genai_config.json")
    return dst
