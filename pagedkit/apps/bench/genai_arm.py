"""The onnxruntime-genai arm: its continuous-batching Engine (`og.Engine`, onnxruntime-genai >= 0.18) on the same
model folder (its genai_config.json: pagedkit's exports write the paged layout genai's engine reads).

For a (B, C) row: B requests of the row's prompts begin their turns at once (greedy, max and min generated tokens =
decode_steps + 1, so an end-of-sequence token does not stop them); the engine runs until none is pending, one
`engine.run()` call a step. TTFT: from the first begin_turn to the step after which every request has its first
token. Decode: every later step, timed one by one (the step's events are host data, so the step has finished):
ms_per_step = the median of the steps in which every request emitted a token, tokens/s = tokens after the first
ones / their steps' time. On CUDA the engine runs the CUDA execution provider of the onnxruntime-gpu it is
installed with (the onnxruntime-genai-cuda wheel); where that or the model cannot run, `unavailable` / the
runner's construction says why and the arm is skipped with that reason.
"""

from __future__ import annotations

import statistics
import time

EVENT_CAPACITY = 4096


def unavailable(device: str) -> str | None:
    """Why the arm cannot run on `device`, or None."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        return "onnxruntime-genai is not installed (pip install onnxruntime-genai, or onnxruntime-genai-cuda on CUDA)"
    if not hasattr(og, "Engine"):
        return f"onnxruntime-genai {getattr(og, '__version__', '?')} has no Engine (0.18 or newer)"
    if device == "cuda" and not (hasattr(og, "is_cuda_available") and og.is_cuda_available()):
        return "this onnxruntime-genai has no CUDA support (install onnxruntime-genai-cuda with onnxruntime-gpu)"
    return None


class GenaiRunner:
    """og.Model + og.Engine over a model folder: on the CPU its providers cleared, on CUDA as its config says."""

    def __init__(self, model_dir: str, device: str):
        import onnxruntime_genai as og

        self.og = og
        cfg = og.Config(str(model_dir))
        if device != "cuda":
            cfg.clear_providers()
        self.model = og.Model(cfg)
        self.engine = og.Engine(self.model)
        self.version = getattr(og, "__version__", None)
        caps = self.engine.get_capabilities()
        self.max_batch_size = int(caps.configured_max_batch_size)

    def run_row(self, row, prompts: list[list[int]]) -> dict:
        """The arm's record of one row (engine_arm.Row; tokens: every request's greedy tokens)."""
        import numpy as np

        og, engine = self.og, self.engine
        if row.batch > self.max_batch_size:
            raise RuntimeError(f"batch {row.batch} exceeds the engine's max_batch_size {self.max_batch_size} "
                               "(genai_config.json engine.dynamic_batching.max_batch_size)")
        buf = engine.create_event_buffer(EVENT_CAPACITY)
        n_new = row.decode_steps + 1
        token_flag, done_flag = int(og.EngineEventFlags.TOKEN), int(og.EngineEventFlags.TURN_FINISHED)
        failed = int(og.EngineEventFlags.FAILED)
        requests, tokens, first = [], [], {}
        t0 = time.perf_counter()
        for p in prompts:
            r = engine.create_request()
            opts = og.TurnOptions(r)
            opts.set_do_sample(False)
            opts.set_max_generated_tokens(n_new)
            opts.set_min_generated_tokens(n_new)
            r.begin_turn(np.asarray(p, dtype=np.int32), opts)
            requests.append(r)
            tokens.append([])
        index = {id(r): i for i, r in enumerate(requests)}
        steps, prefill_steps, ttft = [], 0, None
        try:
            while engine.has_pending_requests():
                s = time.perf_counter()
                events = engine.run(buf)
                now = time.perf_counter()
                emitted = 0
                for ev in events:
                    flags = int(ev.flags)
                    i = index.get(id(ev.request))
                    if flags & failed:
                        raise RuntimeError(f"onnxruntime-genai failed a request: {ev.error_code}")
                    if i is None or not flags & token_flag:
                        continue
                    tokens[i].append(int(ev.token))
                    emitted += 1
                    first.setdefault(i, now)
                if ttft is None:
                    prefill_steps += 1
                    if len(first) == len(requests):
                        ttft = now - t0
                elif emitted:
                    steps.append((now - s, emitted))
                if prefill_steps > 100_000:
                    raise RuntimeError("the engine made no progress")
        finally:
            for r in requests:
                r.close()
        full = [dt for dt, n in steps if n == row.batch] or [dt for dt, _ in steps]
        total = sum(dt for dt, _ in steps)
        emitted = sum(n for _, n in steps)
        if ttft is None or not steps:
            raise RuntimeError(f"onnxruntime-genai's engine gave {sum(map(len, tokens))} tokens for {row.batch} "
                               f"requests of {n_new}")
        return {"ttft_ms": ttft * 1e3, "ttft_first_ms": (min(first.values()) - t0) * 1e3,
                "prefill_steps": prefill_steps, "ms_per_step": statistics.median(full) * 1e3,
                "ms_per_step_mean": total / len(steps) * 1e3, "tokens_per_s": emitted / total if total > 0 else None,
                "decode_tokens": emitted, "decode_steps_run": len(steps), "tokens": tokens}
