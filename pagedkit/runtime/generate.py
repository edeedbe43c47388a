"""Greedy (or teacher-forced) generation over a model folder (model.onnx + genai_config.json) with
pagedkit's InferenceSession.

    gen = Generator("model_dir")                          # session + caches, from genai_config.json
    for step in gen.greedy([1, 5, 9], max_new_tokens=8):   # prefill, then one token per step
        print(step.token)
    gen.history                                           # prompt, steps (token, logits, position)

Parity with Hugging Face eager lives in parity.py.
The config is onnxruntime-genai's (decoder input / output names, layer count, heads, eos, sliding
window layers) or ours (the same plus the `pagedkit` section: block size, cache dtypes, extension
inputs). Two layouts:
- paged (`block_table` in the decoder inputs): caches [NB, BS, Hkv, D] owned by a KVCacheManager
  (windowed layers in their own group read `block_table_windowed`, served from a ring); one plan per
  step; prefill is chunked to what the windowed rings absorb;
- GQA (`attention_mask`): caches [1, Hkv, past, D] grown step by step (present -> next past).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..interface import names as N
from ..interface.genai_config import GENAI_CONFIG, cache_templates, read_genai_config, read_pagedkit_section
from ..interface.paths import check_config_paths, inside_folder
from .generate_state import _GQAState, _PagedState, _torch_type
from .generate_state import layer_cache_spec, resolve_block_size, step_feeds  # noqa: F401 (re-exported: engine)
from .session import InferenceSession, SessionOptions, _cpu_backend
from ..validators.contract import block_size_error
from ..validators.genai_schema import check_genai_config

# parity tolerances (max|diff| <= tol * max|ref|) of a model's logits vs HF eager float32, by model dtype
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


@dataclass
class DecoderConfig:
    """What generation needs from genai_config.json."""

    folder: Path
    filename: str
    num_layers: int
    num_heads: int
    kv_num_heads: int
    head_size: int
    vocab_size: int | None
    eos_token_ids: list[int]
    context_length: int
    inputs: dict[str, str]
    outputs: dict[str, str]
    window: int | None = None  # sliding window of the windowed layers
    window_slack: int = 0  # extra capacity of the windowed GQA caches (sliding_window.cache_slack)
    windowed_layers: list[int] = field(default_factory=list)
    block_size: int | None = None
    chunk_size: int | None = None  # prefill chunk (onnxruntime-genai's search.chunk_size)
    pagedkit: dict = field(default_factory=dict)
    caches: dict = field(default_factory=dict)  # cache kind -> (past, present) '%d' templates

    @property
    def paged(self) -> bool:
        return N.BLOCK_TABLE in self.inputs

    def name(self, key: str, layer: int) -> str:
        """Per-layer I/O name from a '%d' template (past_key_names, present_value_names, ...; defaults:
        onnxruntime-genai's names)."""
        for kind, (past, present) in (self.caches or cache_templates(None)).items():
            if key in (N.past_names_key(kind), N.present_names_key(kind)):
                return N.layer_name(past if key.startswith("past_") else present, layer)
        return self.inputs.get(key, self.outputs.get(key, "")).replace(N.LAYER, str(layer))

    def input(self, name: str) -> str:
        """The graph input the config names for one of names.* (the name itself by default)."""
        return self.inputs.get(name) or name


def read_config(folder: str | Path) -> DecoderConfig:
    folder = Path(folder)
    path = folder / GENAI_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no genai_config.json (a model folder holds model.onnx and genai_config.json)")
    inside_folder(folder, "genai_config.json")  # UnsafePathError: a symlink leading out of the folder
    try:
        cfg = read_genai_config(path)
    except RecursionError:  # json's parser on pathologically nested input
        raise ValueError(f"{path}: JSON nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: the top level is a JSON {type(cfg).__name__}, not an object")
    check_config_paths(cfg, folder, str(path))  # every file it names lies inside the folder
    # every field's JSON type and range, the block sizes the operator's rule, all reported at once
    check_genai_config(cfg, str(path), runtime=True)
    model, dec = cfg["model"], cfg["model"]["decoder"]
    search = cfg.get("search") or {}
    batching = (cfg.get("engine") or {}).get("dynamic_batching") or {}
    section = read_pagedkit_section(cfg)
    eos = model.get("eos_token_id")
    eos = [] if eos is None else list(eos if isinstance(eos, list) else [eos])
    sw = dec.get("sliding_window") or {}
    return DecoderConfig(
        folder=folder, filename=dec.get("filename") or "model.onnx", num_layers=dec["num_hidden_layers"],
        num_heads=dec["num_attention_heads"], kv_num_heads=dec["num_key_value_heads"], head_size=dec["head_size"],
        vocab_size=model.get("vocab_size"), eos_token_ids=eos,
        context_length=model.get("context_length") or search.get("max_length") or 2048,
        inputs=dict(dec.get("inputs") or {}), outputs=dict(dec.get("outputs") or {}),
        window=sw.get("window_size"), window_slack=sw.get("cache_slack") or 0,
        windowed_layers=list(sw.get("layers") or []),
        block_size=section.get("block_size") or batching.get("block_size"),
        chunk_size=search.get("chunk_size"), pagedkit=section, caches=cache_templates(cfg))


@dataclass
class StepResult:
    token: int  # the token chosen (greedy) or given (teacher forcing) after this step
    logits: torch.Tensor  # [V] float32 on the CPU: the logits of the step's last position
    position: int  # position of that last token in the sequence
    seconds: float  # wall time of the step (session runs included)


@dataclass
class History:
    prompt: list[int]
    steps: list[StepResult] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """prompt + every token produced: the sequence a teacher-forced reference reads."""
        return self.prompt + [s.token for s in self.steps]


class _Rows:
    """The float32 logits rows a run keeps in its history, written into chunks of up to 64 rows: numpy asks for huge
    pages on arrays that large, where a fresh 196 KB row a step costs its page faults (about 170 us measured after
    a decode step's run, against about 30 us into a chunk)."""

    def __init__(self, total: int):
        self.left, self.chunk, self.i = total, None, 0

    def put(self, row) -> torch.Tensor:
        import numpy as np

        if self.chunk is None or self.i == len(self.chunk) or self.chunk.shape[1] != row.shape[0]:
            self.chunk, self.i = np.empty((max(1, min(64, self.left)), row.shape[0]), np.float32), 0
        dst = self.chunk[self.i]
        dst[...] = row
        self.i += 1
        self.left -= 1
        return torch.from_numpy(dst)


class Generator:
    """An InferenceSession over a model folder plus the caches of one sequence at a time.

    block_size / num_blocks / shuffle_seed (paged layout): cache geometry (defaults from the model and
    genai_config.json, pools sized for one sequence of max_seq_len) and a shuffled block pool.
    threads: CPU threads (SessionOptions.intra_op_num_threads; None = torch's default).
    allow_reference_fallback: InferenceSession's (None: refused on CUDA, allowed on the CPU).
    cpu_backend: InferenceSession's; None: the environment variable PAGEDKIT_CPU_BACKEND, else "auto"
    (onnxruntime, the fast CPU path of runtime/delegate.py, unless the model holds float16 / bfloat16 weights)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", *, block_size: int | None = None,
                 num_blocks: int | None = None, max_seq_len: int | None = None, shuffle_seed: int | None = None,
                 session: InferenceSession | None = None, threads: int | None = None,
                 allow_reference_fallback: bool | None = None, cpu_backend: str | None = None):
        if block_size is not None and block_size_error(block_size):
            raise ValueError(block_size_error(block_size))
        self.config = read_config(model_dir)
        world = (self.config.pagedkit.get("tensor_parallel") or {}).get("world_size", 1)
        if session is None and world != 1:
            raise ValueError(f"{model_dir} is a tensor-parallel export of {world} ranks: run it with --tp {world} "
                             "(paged-run), or pass the session of a pagedkit.runtime.distributed.TensorParallel set")
        providers = ["CUDAExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
        model_path = inside_folder(model_dir, self.config.filename, "model.decoder.filename",
                                   str(Path(model_dir) / "genai_config.json"))
        options = SessionOptions(intra_op_num_threads=threads) if threads else None
        self.session = session or InferenceSession(str(model_path), options, providers=providers,
                                                   allow_reference_fallback=allow_reference_fallback,
                                                   cpu_backend=_cpu_backend(cpu_backend, "auto"))
        self.max_seq_len = min(max_seq_len or self.config.context_length, self.config.context_length)
        self.logits_name = self.config.outputs.get(N.LOGITS) or N.LOGITS
        self.state = (_PagedState(self, block_size, num_blocks, shuffle_seed) if self.config.paged
                      else _GQAState(self))
        self.history: History | None = None

    @property
    def dtype(self) -> torch.dtype:
        """The precision the model's attention keeps its caches in (its first cache input's element type, or
        float32); parity tolerances follow it (TOLERANCES). An fp32 export with fp16 caches is float16 here."""
        name = self.config.name(N.past_names_key("key"), 0)
        arg = next((a for a in self.session.get_inputs() if a.name == name), None)
        dt = _torch_type(arg.type) if arg is not None else torch.float32
        return dt if dt in TOLERANCES else torch.float16

    @property
    def activation_dtype(self) -> torch.dtype:
        """The model's activation precision: its logits' element type (float32 for an fp32 export)."""
        arg = next((a for a in self.session.get_outputs() if a.name == self.logits_name), None)
        return _torch_type(arg.type) if arg is not None else self.dtype

    def run(self, prompt: Sequence[int], max_new_tokens: int, forced: Sequence[int] | None = None,
            stop_at_eos: bool = True) -> Iterator[StepResult]:
        """Prefill `prompt`, then decode: each step yields the next token (greedy, or forced[k] when
        teacher-forcing) with the logits it came from. self.history records the run."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if forced is not None:
            max_new_tokens = len(forced)
        if len(prompt) + max_new_tokens > self.max_seq_len + 1:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds the context "
                             f"length {self.max_seq_len}")
        self.history = History(prompt)
        store = _Rows(max_new_tokens)
        self.state.start(prompt)
        try:
            feed, pos = prompt, len(prompt) - 1
            for k in range(max_new_tokens):
                t0 = time.perf_counter()
                out = self.state.step(feed, last_only=True)
                if out.dtype == torch.float32 and not out.is_cuda:  # a copy of its own: the state's buffer is the
                    row = out.numpy()[-1]  # next step's
                    logits = store.put(row)
                else:
                    logits = out[-1].float().cpu()
                    row = logits.numpy()
                token = int(forced[k]) if forced is not None else int(row.argmax())
                step = StepResult(token, logits, pos, time.perf_counter() - t0)
                self.history.steps.append(step)
                yield step
                if forced is None and stop_at_eos and token in self.config.eos_token_ids:
                    break
                if k + 1 < max_new_tokens:
                    feed, pos = [token], pos + 1
        finally:
            self.state.finish()

    def greedy(self, prompt: Sequence[int], max_new_tokens: int = 32, stop_at_eos: bool = True) -> Iterator[StepResult]:
        return self.run(prompt, max_new_tokens, stop_at_eos=stop_at_eos)

    def teacher_forced(self, prompt: Sequence[int], continuation: Sequence[int]) -> list[StepResult]:
        """Logits after the prompt and after each continuation token but the last."""
        return list(self.run(prompt, len(continuation), forced=continuation))

