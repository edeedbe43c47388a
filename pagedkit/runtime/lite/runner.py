"""LiteGenerator: greedy generation on the CPU with onnxruntime and numpy alone (no torch in the process), over the
CPU plan of a model folder (runtime/lite/artifact.py; made once by a child process).

    gen = LiteGenerator("model_dir", threads=2)                       # the plan, made if missing; one session
    for tokens in gen.generate([[1, 5, 9], [1, 7]], max_new_tokens=8):  # the prompts in one prefill, then decode
        print(tokens)                                                  # one token per live sequence, None once done

The same onnxruntime model as the torch path's (Generator on the onnxruntime CPU backend), so the same logits; what
differs is the host: caches [NB, BS, ...] are numpy arrays bound once, sequence b owns blocks
[b * per_seq, (b + 1) * per_seq), the step inputs of the operator contract are written into persistent arrays in
place, the logits land in a buffer of the runner's, and the argmax is numpy's (ties and NaN: the first index).
Served: paged models whose whole graph is one onnxruntime segment, without sliding-window layers (compile.py says
why another is refused: LiteUnavailable).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .artifact import SEGMENT_FILE, LiteUnavailable, read_plan
from .make import ensure_plan


def _session(plan_dir: Path, plan: dict, folder: Path, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if plan["spin"] else "0")
    if plan["external"]:  # the model's external data and the plan's segment.data, mapped from the model folder
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    if plan["library"]:  # never the path plan.json names: this pagedkit's own build of the library
        from ...kernels.cpu.build import library

        path, why = library()
        if path is None:
            raise LiteUnavailable(f"the CPU attention library is not available: {why}")
        if Path(path).name != Path(str(plan["library"])).name:
            raise LiteUnavailable(f"the plan was made with another build of the CPU attention library "
                                  f"({Path(str(plan['library'])).name}, this one is {Path(path).name})")
        so.register_custom_ops_library(path)
    return ort.InferenceSession((plan_dir / SEGMENT_FILE).read_bytes(), so, providers=["CPUExecutionProvider"])


@dataclass
class LiteStep:
    token: int  # the greedy token after this step
    logits: np.ndarray | None  # [V] float32 copy of the step's last-position logits (run(keep_logits=True))
    position: int  # the position of the step's last token
    seconds: float  # wall time of the step


@dataclass
class LiteHistory:
    prompt: list[int]
    steps: list[LiteStep] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """prompt + every token produced (what a teacher-forced reference reads)."""
        return self.prompt + [s.token for s in self.steps]


class LiteGenerator:
    """Greedy generation of up to `max_batch_size` sequences at once, in lockstep (see the module doc).

    threads: onnxruntime's intra-op threads (None: os.cpu_count(), as the torch path). max_seq_len: the longest
    prompt + new tokens (default: the model's context length)."""

    def __init__(self, model_dir: str | os.PathLike, *, threads: int | None = None, max_seq_len: int | None = None,
                 max_batch_size: int = 1):
        self.folder = Path(model_dir).resolve()
        self.threads = max(1, int(threads or os.cpu_count() or 1))
        self.plan_dir = ensure_plan(self.folder, self.threads)
        self.plan = plan = read_plan(self.plan_dir)
        self.session = _session(self.plan_dir, plan, self.folder, self.threads)
        self.max_seq_len = int(min(max_seq_len or plan["context_length"], plan["context_length"]))
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        self.max_batch_size = int(max_batch_size)
        self.block_size = bs = int(plan["block_size"])
        self.blocks_per_seq = math.ceil(self.max_seq_len / bs)
        nb = self.max_batch_size * self.blocks_per_seq
        from onnxruntime import OrtValue

        # caches [NB, BS, ...], zeros, bound once (onnxruntime reads and writes this memory)
        self.caches = {n: np.zeros([nb] + c["block_shape"], c["dtype"]) for n, c in plan["caches"].items()}
        self._binding = self.session.io_binding()
        self._values = {n: OrtValue.ortvalue_from_numpy(a) for n, a in self.caches.items()}
        for n, v in self._values.items():
            self._binding.bind_ortvalue_input(n, v)
        for out, src in plan["aliases"].items():  # caches computed into their input's buffer
            self._binding.bind_ortvalue_output(out, self._values[src])
        self._shape = None  # (batch, tokens) of the step inputs bound last
        self.eos = set(plan["eos_token_ids"])
        self.history: LiteHistory | None = None

    # ---- one step ----
    def _bind_step(self, query_lens: Sequence[int]) -> dict[str, np.ndarray]:
        """Bind fresh step arrays for a step of these per-sequence token counts (shapes change: prefill, or
        another batch); a decode step of the same batch reuses them."""
        from onnxruntime import OrtValue

        plan, b, t = self.plan, len(query_lens), int(sum(query_lens))
        dt = plan["step_dtypes"]
        shapes = {"input_ids": (t,), "cu_seqlens": (b + 1,), "past_seqlens": (b,),
                  "block_table": (b, self.blocks_per_seq), "slot_mapping": (t,), "query_positions": (t,),
                  "logit_rows": (b,)}
        arrays = {r: np.zeros(shapes[r], dt[r]) for r in plan["roles"]}
        rows = b if "logit_rows" in plan["roles"] else t
        arrays["logits"] = np.empty((rows, self._vocab()), plan["logits_dtype"])
        self._keep = [OrtValue.ortvalue_from_numpy(a) for a in arrays.values()]  # alive while bound
        for (role, a), v in zip(arrays.items(), self._keep):
            if role == "logits":
                self._binding.bind_ortvalue_output(plan["logits"], v)
            else:
                self._binding.bind_ortvalue_input(plan["roles"][role], v)
        arrays["block_table"][:] = np.arange(b)[:, None] * self.blocks_per_seq + np.arange(self.blocks_per_seq)
        if t == b:  # one token each: token i is sequence i's last (step() writes these only when t != b)
            arrays["cu_seqlens"][:] = np.arange(b + 1)
            if "logit_rows" in arrays:
                arrays["logit_rows"][:] = np.arange(b)
        self._arrays, self._shape = arrays, (b, t)
        return arrays

    def _vocab(self) -> int:
        """The logits' vocabulary size: the model's static dimension, else genai_config's vocab_size (at most
        2^24: a larger one is a malformed config, not a buffer to allocate)."""
        shape = next(o.shape for o in self.session.get_outputs() if o.name == self.plan["logits"])
        if shape and isinstance(shape[-1], int) and shape[-1] > 0:
            return shape[-1]
        vocab = self.plan["vocab_size"]
        if not isinstance(vocab, int) or not 0 < vocab <= 1 << 24:
            raise ValueError(f"the logits' vocabulary dimension is not static in the model and genai_config's "
                             f"vocab_size is {vocab!r} (expected 1 .. {1 << 24})")
        return vocab

    def step(self, past: Sequence[int], tokens: Sequence[Sequence[int]]) -> np.ndarray:
        """Run one step: sequence b (slot b of the batch) has past[b] tokens cached and adds tokens[b]. Returns
        the logits of each sequence's last token [B, V] (a buffer the next step overwrites)."""
        lens = [len(x) for x in tokens]
        b, t = len(lens), sum(lens)
        if b > self.max_batch_size or any(p + n > self.max_seq_len for p, n in zip(past, lens)) or min(lens) < 1:
            raise ValueError(f"step: {b} sequences (at most {self.max_batch_size}), lengths past + new "
                             f"{[p + n for p, n in zip(past, lens)]} (at most max_seq_len {self.max_seq_len}, "
                             "each adding >= 1 token)")
        a = self._arrays if self._shape == (b, t) else self._bind_step(lens)
        roles = self.plan["roles"]
        if t == b:  # one token each (decode): cumulative lengths and logit rows are the shape's constants
            a["input_ids"][:] = [seq[0] for seq in tokens]
            ends = None
        else:
            ends = np.cumsum(lens)
            a["input_ids"][:] = [x for seq in tokens for x in seq]
            a["cu_seqlens"][1:] = ends
            if "logit_rows" in roles:
                a["logit_rows"][:] = ends - 1
        if "past_seqlens" in a:
            a["past_seqlens"][:] = past
        if "query_positions" in a or "slot_mapping" in a:
            pos = np.concatenate([np.arange(p, p + n) for p, n in zip(past, lens)])
            if "query_positions" in a:
                a["query_positions"][:] = pos
            if "slot_mapping" in a:
                seq = np.repeat(np.arange(b), lens)
                a["slot_mapping"][:] = (a["block_table"][seq, pos // self.block_size] * self.block_size
                                        + pos % self.block_size)
        self.session.run_with_iobinding(self._binding)
        return a["logits"] if ends is None or "logit_rows" in roles else a["logits"][ends - 1]

    # ---- generation ----
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop_at_eos: bool = True) -> Iterator[list[int | None]]:
        """Greedy: the prompts in one prefill step, then one decode step per token. Yields, per step, each
        sequence's token (None for a sequence that already ended at an end-of-sequence token)."""
        prompts = [list(map(int, p)) for p in prompts]
        if not prompts or any(not p for p in prompts):
            raise ValueError("generate: expected one or more non-empty prompts")
        if max(len(p) for p in prompts) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"generate: prompt + max_new_tokens = {max(len(p) for p in prompts) + max_new_tokens} "
                             f"tokens exceeds max_seq_len {self.max_seq_len}")
        past = [0] * len(prompts)
        feed = prompts
        done = [False] * len(prompts)
        for _ in range(max_new_tokens):
            logits = self.step(past, feed)
            toks = np.argmax(logits, axis=-1).tolist()
            past = [p + len(f) for p, f in zip(past, feed)]
            out = [None if d else t for d, t in zip(done, toks)]
            yield out
            if stop_at_eos:
                done = [d or t in self.eos for d, t in zip(done, toks)]
                if all(done):
                    return
            feed = [[t] for t in toks]  # ended sequences keep stepping (lockstep); their tokens are not yielded

    def run(self, prompt: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True,
            keep_logits: bool = False) -> Iterator[LiteStep]:
        """One sequence, greedy, step by step (timed; the logits kept where asked): self.history records it."""
        prompt = [int(t) for t in prompt]
        if not prompt or len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"run: a prompt of {len(prompt)} tokens (at least 1) + max_new_tokens {max_new_tokens} "
                             f"must fit max_seq_len {self.max_seq_len}")
        self.history = LiteHistory(prompt)
        past, feed = 0, prompt
        for _ in range(max_new_tokens):
            t0 = time.perf_counter()
            row = self.step([past], [feed])[0]
            token = int(np.argmax(row))
            keep = row.astype(np.float32, copy=True) if keep_logits else None
            past += len(feed)
            step = LiteStep(token, keep, past - 1, time.perf_counter() - t0)
            self.history.steps.append(step)
            yield step
            if stop_at_eos and token in self.eos:
                return
            feed = [token]

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
        """The greedy continuation of one prompt."""
        return [t[0] for t in self.generate([prompt], max_new_tokens, stop_at_eos) if t[0] is not None]


__all__ = ["LiteGenerator", "LiteHistory", "LiteStep"]
