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

import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..interface import dtypes
from ..interface import names as N
from ..interface.genai_config import GENAI_CONFIG, cache_templates, read_genai_config, read_pagedkit_section
from ..interface.paths import check_config_paths, inside_folder
from .kv.cache import KVCacheManager
from .kv.config import GroupConfig, KVCacheConfig, LayerCacheSpec
from .session import InferenceSession, SessionOptions, _cpu_backend
from ..validators.contract import CACHE_FORMATS, block_size_error
from ..validators.genai_schema import check_genai_config

# parity tolerances (max|diff| <= tol * max|ref|) of a model's logits vs HF eager float32, by model dtype
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}
# ONNX type string of a cache input -> the cache dtype spelling of KVCacheConfig (uint8 -> int4)
_CACHE_DTYPE = {f.storage: name for name, f in CACHE_FORMATS.items()}


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


def _torch_type(type_str: str) -> torch.dtype:
    return dtypes.torch_dtype(type_str)


def resolve_block_size(cfg: DecoderConfig, key_dims: Sequence, requested: int | None = None, who: str = "") -> int:
    """The block size of a paged model: `requested` (refused where the graph fixes another), else the graph's
    static dimension 1 of the first layer's key cache input (`key_dims`: its shape, ints or names), else
    genai_config's pagedkit block_size, else 16."""
    fixed = key_dims[1] if len(key_dims) > 1 and isinstance(key_dims[1], int) else None
    if requested and fixed and requested != fixed:
        key0 = cfg.name(N.past_names_key("key"), 0)
        raise ValueError(f"{who}block_size {requested}: the model's caches fix block_size {fixed} "
                         f"(input '{key0}' dimension 1); use {fixed}")
    return requested or fixed or cfg.block_size or 16


def step_feeds(plan, mgr: KVCacheManager, token_ids: Sequence[int] | torch.Tensor, renames: dict, input_names,
               input_ids_name: str) -> dict[str, torch.Tensor]:
    """The model inputs of one planned step of a paged model (token_ids: the plan's T tokens, batch order, or the
    input_ids tensor itself): the plan's step inputs under the model's names (`renames`), the caches and
    input_ids; only names in `input_names`."""
    feeds = {renames.get(k, k): v for k, v in plan.feeds(query_positions=True).items()}
    feeds = {k: v for k, v in feeds.items() if k in input_names}
    feeds |= {k: v for k, v in mgr.cache_feeds().items() if k in input_names}
    feeds[input_ids_name] = token_ids if isinstance(token_ids, torch.Tensor) else torch.tensor(
        list(token_ids), dtype=torch.int64, device=mgr.config.device)
    return feeds


def layer_cache_spec(cfg: DecoderConfig, args: dict, i: int) -> LayerCacheSpec:
    """Layer i's cache spec from the session's inputs `args` (name -> NodeArg): dtype, KV heads, head size, scales."""
    key = args.get(cfg.name(N.past_names_key("key"), i))
    if key is None:
        raise ValueError(f"model has no cache input {cfg.name(N.past_names_key('key'), i)!r} for layer {i}")
    if key.type not in _CACHE_DTYPE:
        raise ValueError(f"input {key.name!r}: cache element type {key.type} is not a paged cache type")
    kv = key.shape[2] if len(key.shape) > 2 and isinstance(key.shape[2], int) else cfg.kv_num_heads
    layers = {int(l["layer"]): l for l in cfg.pagedkit.get("layers", [])}
    head = int(layers.get(i, {}).get("head_size", cfg.head_size))
    scales = {}
    for side in ("key", "value"):
        s = args.get(cfg.name(N.past_names_key(f"{side}_scale"), i))
        scales[side] = dtypes.numpy_name(dtypes.elem_type(s.type)) if s is not None else None  # float16 / 32
    return LayerCacheSpec(i, kv, head, _CACHE_DTYPE[key.type], scales["key"], scales["value"],
                          latent=cfg.name(N.past_names_key("value"), i) not in args)


class _PagedState:
    """The paged layout: a KVCacheManager owns the caches; one plan per step."""

    def __init__(self, gen: "Generator", block_size: int | None, num_blocks: int | None, shuffle_seed: int | None):
        cfg, sess = gen.config, gen.session
        args = {a.name: a for a in sess.get_inputs()}
        key0 = cfg.name(N.past_names_key("key"), 0)
        bs = resolve_block_size(cfg, args[key0].shape if key0 in args else [], block_size)
        self.max_seq_len = gen.max_seq_len
        chunk = max(1, min(cfg.chunk_size or bs, self.max_seq_len)) if cfg.windowed_layers else self.max_seq_len
        groups = []
        for windowed in (False, True):
            layers = [layer_cache_spec(cfg, args, i) for i in range(cfg.num_layers) if (i in cfg.windowed_layers) == windowed]
            if not layers:
                continue
            table = cfg.inputs.get(N.BLOCK_TABLE_WINDOWED if windowed else N.BLOCK_TABLE)
            per_seq = math.ceil(self.max_seq_len / bs)
            g = GroupConfig("windowed" if windowed else "full", 1, bs, tuple(layers),
                            window=cfg.window if windowed else None, chunk_tokens=chunk, table_name=table)
            n = num_blocks or (g.ring_blocks if windowed else per_seq) + 2
            groups.append(GroupConfig(g.name, n, bs, g.layers, g.window, chunk, table))
        names = {kind: past for kind, (past, _) in cfg.caches.items()}
        present = {kind: pres for kind, (_, pres) in cfg.caches.items()}
        self.mgr = KVCacheManager(KVCacheConfig(tuple(groups), max_batch_size=1, max_num_tokens=self.max_seq_len,
                                                max_seq_len=self.max_seq_len, device=str(gen.session.device),
                                                names=names, present_names=present))
        if shuffle_seed is not None:  # block ids out of order and non-contiguous, as in a busy engine
            for pool in self.mgr.pools.values():
                free = list(pool.free)
                random.Random(shuffle_seed).shuffle(free)
                pool.free.clear()
                pool.free.extend(free)
        self.renames = {k: cfg.input(k) for k in N.STEP_INPUTS}
        self.input_names = set(args)
        self.gen = gen
        self.seq = 0
        self._direct = None  # the direct path after the first step (_setup_direct), or False

    def start(self, prompt: Sequence[int]) -> None:
        self.seq += 1
        self.mgr.add_sequence(self.seq, list(prompt))

    def step(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """Run `ids` (chunked as the windowed rings need) -> their logits [len(ids), V], valid until the next step
        (on the direct path they live in a buffer the next step writes). last_only: the caller reads the last row
        only; where the model can compute the logits of chosen rows (kernels/cpu/logits.py), each chunk's last row
        alone is computed (a prefill skips the LM head of the other prompt tokens) and fewer rows come back."""
        mgr, sess = self.mgr, self.gen.session
        logits = []
        done = 0
        while done < len(ids):  # chunked so that windowed rings absorb each step
            n = min(len(ids) - done, mgr.max_step_tokens(self.seq))
            chunk = list(ids[done:done + n])
            plan = mgr.plan([(self.seq, chunk)])
            try:
                rows = n
                if self._direct:
                    out, rows = self._run_direct(plan, chunk, last_only)
                else:
                    feeds = step_feeds(plan, mgr, chunk, self.renames, self.input_names,
                                       self.gen.config.input(N.INPUT_IDS))
                    out = sess.run_torch(feeds, [self.gen.logits_name], plan=plan.hint,
                                         distinct_slots=True)[self.gen.logits_name]  # a manager plan: distinct slots
                    if self._direct is None:
                        self._direct = self._setup_direct(feeds)
            except BaseException:
                mgr.abort(plan)
                raise
            mgr.commit(plan)
            out = out if out.dim() == 2 and out.shape[0] == rows else out.reshape(rows, -1)
            done += n
            logits.append(out.clone() if self._direct and done < len(ids) else out)  # the next chunk reuses it
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def finish(self) -> None:
        self.mgr.free(self.seq)

    # ---- the direct path: a model that is one onnxruntime segment, fed without run_torch's per-call checks ----
    def _setup_direct(self, feeds: dict) -> tuple | bool:
        """After a first step through run_torch (its feed checks passed): when the whole model is one onnxruntime
        segment (InferenceSession.single_segment), the input list it takes with the caches in place, the
        positions of the per-step inputs and of the logits; else False. A decode step then skips run_torch's feed
        checks and the caches' lookups, and the segment binds nothing (the manager's step tensors and the id buffer
        are the same objects every step; the logits go to a buffer of the segment's: Segment.run keep)."""
        direct = self.gen.session.single_segment()
        if direct is None:
            return False
        from ..kernels.cpu.logits import ROWS_INPUT

        seg, names, outputs, constants = direct
        fixed = self.mgr.cache_feeds() | constants
        ins = [fixed.get(n) for n in names]
        step = [(n, i) for i, n in enumerate(names) if n not in fixed]
        if any(n not in feeds for n, _ in step) or self.gen.logits_name not in outputs:
            return False
        self._id_buf = torch.zeros(self.max_seq_len, dtype=torch.int64)
        self._id_np, self._ids = self._id_buf.numpy(), {}
        self._rows = None  # (its position, the model's default (every row), a one-row buffer and its numpy view)
        if ROWS_INPUT in names:
            last = torch.zeros(1, dtype=torch.int64)
            self._rows = (names.index(ROWS_INPUT), constants[ROWS_INPUT], last, last.numpy())
        return seg, ins, step, outputs.index(self.gen.logits_name)

    def _run_direct(self, plan, chunk: list[int], last_only: bool = False) -> tuple[torch.Tensor, int]:
        """(the chunk's logits, their rows: len(chunk), or 1 when only the last row was computed)."""
        seg, ins, step, logits = self._direct
        rows = len(chunk)
        if self._rows is not None:
            at, every, last, last_np = self._rows
            if last_only:
                last_np[0] = len(chunk) - 1
                ins[at], rows = last, 1
            else:
                ins[at] = every
        feeds = {self.renames.get(k, k): v for k, v in plan.feeds(query_positions=True).items()}
        n = len(chunk)
        ids = self._ids.get(n)  # views of one persistent id buffer, written through numpy (no torch op a step)
        if ids is None:
            ids = self._ids[n] = self._id_buf[:n]
        self._id_np[:n] = chunk
        feeds[self.gen.config.input(N.INPUT_IDS)] = ids
        for name, i in step:
            ins[i] = feeds[name]
        return seg.run(ins, keep=True)[logits], rows


class _GQAState:
    """The GQA layout: caches [1, Hkv, past, D] grown step by step (present -> next past)."""

    def __init__(self, gen: "Generator"):
        self.gen = gen
        self.args = {a.name: a for a in gen.session.get_inputs()}
        cfg = gen.config
        self.pairs = []  # (past input, present output)
        self.windowed = set()  # past inputs of windowed layers
        for i in range(cfg.num_layers):
            for side in ("key", "value"):
                past, present = cfg.name(N.past_names_key(side), i), cfg.name(N.present_names_key(side), i)
                if past in self.args:
                    self.pairs.append((past, present))
                    if cfg.window and i in cfg.windowed_layers:
                        self.windowed.add(past)
        self.window_capacity = int(cfg.window or 0) + cfg.window_slack

    def start(self, prompt: Sequence[int]) -> None:
        dev = self.gen.session.device
        self.past = {}
        for name, _ in self.pairs:
            a = self.args[name]
            kv = a.shape[1] if isinstance(a.shape[1], int) else self.gen.config.kv_num_heads
            d = a.shape[3] if isinstance(a.shape[3], int) else self.gen.config.head_size
            # windowed layers (sliding_window_cache=1) keep a fixed buffer of the window's capacity
            cap = self.window_capacity if name in self.windowed else 0
            self.past[name] = torch.zeros(1, kv, cap, d, dtype=_torch_type(a.type), device=dev)
        self.length = 0

    def step(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        cfg, sess, dev = self.gen.config, self.gen.session, self.gen.session.device
        n, total = len(ids), self.length + len(ids)
        feeds = dict(self.past)
        feeds[cfg.input(N.INPUT_IDS)] = torch.tensor([list(ids)], dtype=torch.int64, device=dev)
        mask = cfg.input(N.ATTENTION_MASK)
        if mask in self.args:
            feeds[mask] = torch.ones(1, total, dtype=_torch_type(self.args[mask].type), device=dev)
        pos = cfg.input(N.POSITION_IDS)
        if pos in self.args:
            feeds[pos] = torch.arange(self.length, total, device=dev).reshape(1, n).to(_torch_type(self.args[pos].type))
        names = [self.gen.logits_name] + [p for _, p in self.pairs]
        out = sess.run_torch(feeds, names)
        self.past = {past: out[present] for past, present in self.pairs}
        self.length = total
        return out[self.gen.logits_name].reshape(n, -1)

    def finish(self) -> None:
        self.past = {}


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

