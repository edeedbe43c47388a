"""`paged-run`: greedy generation over a model folder with pagedkit's runtime, and parity with Hugging Face.

    paged-run MODEL_DIR --prompt-ids 1,2,3 [--max-new-tokens N] [--device cpu|cuda]
    paged-run MODEL_DIR --prompt "some text"              # needs MODEL_DIR/tokenizer.json
    paged-run MODEL_DIR --prompt-ids 1,2,3 --parity HF_CHECKPOINT_DIR
    paged-run MODEL_DIR --prompt "some text" --parity   # the checkpoint paged-export recorded
    paged-run TP_DIR --prompt-ids 1,2,3 --tp 2          # a paged-export --tp 2 folder on 2 ranks

MODEL_DIR holds model.onnx and genai_config.json (pagedkit's or onnxruntime-genai's). Tokens are
printed as they come (text when MODEL_DIR has a tokenizer, else ids), then a summary (tokens/s).
--parity runs Hugging Face eager (float32, the local folder or .gguf only, no remote code, offline;
without a path, the source checkpoint paged-export recorded in genai_config.json) teacher-forced over
the same tokens and prints, step by step, the largest logit difference and whether the greedy tokens
agree, then how many steps were compared and how many were near-ties (HF's own top-2 logits closer than
the tolerance: only there may the tokens differ; see pagedkit/runtime/parity.py). --tp N runs a
tensor-parallel export (`paged-export --tp N`) on N ranks this command starts (one process per device: on the
CPU N processes on gloo, on CUDA GPUs 0..N-1 on NCCL; docs/distributed.md): this process is rank 0 and plans
every step. A rank that dies or hangs past the collective timeout ends the run with one error line. Exit status:
0 ok, 1 parity failure, 2 bad arguments or model (or a failed tensor-parallel set).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ... import settings
from ...cli_errors import cli_main, one_line, report as report_error
from ...runtime.distributed.group import TPError


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids needs at least one token id")
    return ids


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged-run", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="folder with model.onnx and genai_config.json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids", type=_parse_ids, help="prompt token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="prompt text (tokenized with MODEL_DIR/tokenizer.json)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--parity", metavar="HF_CHECKPOINT", nargs="?", const="",
                   help="compare with Hugging Face eager: a local checkpoint folder or .gguf; without a value, the "
                        "source checkpoint paged-export recorded in genai_config.json")
    p.add_argument("--tol", type=float, help="parity tolerance on max|diff| / max|ref| "
                                             "(default: 1e-4 for float32 models, 2e-2 for float16 / bfloat16)")
    p.add_argument("--block-size", type=int, help="KV block size (paged layout; default from the model / config)")
    p.add_argument("--threads", type=int, help="CPU threads (like onnxruntime's intra_op_num_threads; "
                                               "default: torch's, one per core)")
    p.add_argument("--cpu-backend", choices=["auto", "lite", "onnxruntime", "torch"],
                   help="on the CPU, who runs the model: lite (the whole model as one onnxruntime session, run "
                        "without torch: runtime/lite), onnxruntime (onnxruntime's CPU execution provider under "
                        "pagedkit's session) or torch (pagedkit's torch kernels); auto (default): lite where it "
                        "serves the model (docs/cpu.md), else onnxruntime unless the model holds float16 / "
                        "bfloat16 weights")
    p.add_argument("--tp", type=int, metavar="N",
                   help="run a tensor-parallel export (paged-export --tp N) on N ranks started here (default: the "
                        "folder's own world size; a single-device folder runs alone)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--allow-reference-fallback", action="store_true",
                   help="on --device cuda, run attention nodes no GPU kernel serves on the loop-based reference "
                        "(slow, not CUDA-graph capturable) instead of refusing the model")
    return p


def _tokenizer(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from ...interface.paths import inside_folder
    from tokenizers import Tokenizer

    inside_folder(model_dir, "tokenizer.json")  # UnsafePathError: a symlink leading out of the folder
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises its own Exception for a malformed file
        raise ValueError(f"{path}: not a tokenizer file ({one_line(str(exc))})") from None


def _precision(gen) -> str:
    act, att = (str(t).replace("torch.", "") for t in (gen.activation_dtype, gen.dtype))
    return act if act == att else f"{act}, attention caches {att}"


def _lite(args, model_dir: Path, max_seq_len: int):
    """runtime/lite's LiteGenerator where it serves this run (the CPU, no --tp / --block-size /
    --allow-reference-fallback, --cpu-backend auto or lite), else None; --cpu-backend lite and a model it refuses:
    ValueError with its reason."""
    backend = args.cpu_backend or settings.read("PAGEDKIT_CPU_BACKEND") or "auto"
    if backend not in ("auto", "lite") or args.device != "cpu":
        return None
    other = [f for f, v in (("--tp", args.tp), ("--block-size", args.block_size),
                            ("--allow-reference-fallback", args.allow_reference_fallback)) if v]
    from ...runtime.lite import LiteGenerator, LiteUnavailable

    try:
        if other:
            raise LiteUnavailable(f"{', '.join(other)} is served by the torch path")
        return LiteGenerator(model_dir, threads=args.threads, max_seq_len=max_seq_len)
    except LiteUnavailable as exc:
        if backend == "lite":
            raise ValueError(f"--cpu-backend lite: {exc}") from None
        return None


def _lite_precision(gen) -> str:
    key = next(iter(gen.plan["caches"].values()))["dtype"]
    act = gen.plan["logits_dtype"]
    return act if act == key else f"{act}, attention caches {key}"


def _dtype(gen):
    """The dtype whose parity tolerance applies (Generator.dtype's rule: the first cache's, else float16)."""
    import torch

    if not hasattr(gen, "plan"):
        return gen.dtype
    key = next(iter(gen.plan["caches"].values()))["dtype"]
    return {"float32": torch.float32, "float16": torch.float16}.get(key, torch.float16)


@cli_main("paged-run")
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sets: list = []  # the tensor-parallel set this run starts, stopped whatever happens
    try:
        return _main(args, sets)
    finally:
        for tp in sets:
            tp.close()


def _session(args, model_dir: Path, sets: list):
    """None (Generator makes its own session), or rank 0's session of the tensor-parallel set started here."""
    from ...runtime.distributed import TensorParallel, resolve_world
    from ...runtime.session import _cpu_backend

    if args.tp is None:  # a tensor-parallel folder run without --tp is refused by Generator, after its folder checks
        return None
    world = resolve_world(model_dir, args.tp, "paged-run: --tp: ")
    if world == 1:
        return None
    tp = TensorParallel(world, args.device, threads=args.threads)
    sets.append(tp)
    return tp.session(model_dir, threads=args.threads, cpu_backend=_cpu_backend(args.cpu_backend, "auto"),
                      allow_reference_fallback=args.allow_reference_fallback or None)


def _main(args, sets: list) -> int:
    settings.stay_offline("HF_HUB_OFFLINE")
    model_dir = Path(args.model_dir)
    if args.max_new_tokens < 1:
        print("paged-run: --max-new-tokens should be >= 1", file=sys.stderr)
        return 2
    if args.block_size is not None:
        from ...validators.contract import block_size_error

        if block_size_error(args.block_size):
            print(f"paged-run: --block-size: {block_size_error(args.block_size)}", file=sys.stderr)
            return 2
    if args.threads is not None and args.threads < 1:
        print(f"paged-run: --threads should be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("paged-run: --device cuda but CUDA is not available", file=sys.stderr)
            return 2
    try:
        tok = _tokenizer(model_dir)
        if args.prompt is not None:
            if tok is None:
                print(f"paged-run: --prompt needs {model_dir / 'tokenizer.json'} (or use --prompt-ids)", file=sys.stderr)
                return 2
            prompt = tok.encode(args.prompt).ids
        else:
            prompt = args.prompt_ids
        t0 = time.perf_counter()
        gen = _lite(args, model_dir, len(prompt) + args.max_new_tokens)
        if gen is None:
            from ...runtime.generate import Generator

            # caches sized for this run (prompt + new tokens), not for the config's context_length
            session = _session(args, model_dir, sets)
            gen = Generator(model_dir, device=args.device, block_size=args.block_size,
                            max_seq_len=len(prompt) + args.max_new_tokens, threads=args.threads,
                            allow_reference_fallback=args.allow_reference_fallback or None,
                            cpu_backend=args.cpu_backend, session=session)
        setup = time.perf_counter() - t0
    except (OSError, ValueError, NotImplementedError) as exc:
        return report_error("paged-run", exc)
    except TPError as exc:  # a rank that failed to start or load: one line, status 2
        return report_error("paged-run", ValueError(str(exc)))
    ranks = f" x {sets[0].world} tensor-parallel ranks" if sets else ""
    if hasattr(gen, "plan"):  # runtime/lite
        print(f"model: {model_dir} (paged layout, {gen.plan['num_layers']} layers, {_lite_precision(gen)}) on cpu, "
              f"runtime/lite (the model as one onnxruntime session), session ready in {setup:.2f} s")
    else:
        cfg = gen.config
        print(f"model: {model_dir} ({'paged' if cfg.paged else 'GQA'} layout, {cfg.num_layers} layers, "
              f"{_precision(gen)}) on {args.device}{ranks}, session ready in {setup:.2f} s")
    print(f"prompt: {len(prompt)} tokens {prompt}")
    tokens, shown = [], ""
    try:
        steps = (gen.run(prompt, args.max_new_tokens, stop_at_eos=not args.ignore_eos,
                         keep_logits=args.parity is not None) if hasattr(gen, "plan")
                 else gen.greedy(prompt, args.max_new_tokens, stop_at_eos=not args.ignore_eos))
        for step in steps:
            tokens.append(step.token)
            if tok is not None:
                text = tok.decode(tokens)
                print(text[len(shown):], end="", flush=True)
                shown = text
            else:
                print(f"{' ' if len(tokens) > 1 else ''}{step.token}", end="", flush=True)
    except (ValueError, RuntimeError, TypeError) as exc:  # a model that fails at run time (feeds, cache pool)
        print(file=sys.stderr)
        bad = exc if isinstance(exc, ValueError) else ValueError(f"{type(exc).__name__}: {exc}")
        return report_error("paged-run", bad)
    print()
    steps = gen.history.steps
    prefill, decode = steps[0].seconds, sum(s.seconds for s in steps[1:])
    rate = f"{(len(steps) - 1) / decode:.1f} tokens/s" if len(steps) > 1 and decode > 0 else "n/a"
    print(f"ids: {tokens}")
    print(f"generated {len(tokens)} tokens: prefill {len(prompt)} tokens in {prefill:.3f} s, "
          f"decode {len(steps) - 1} tokens in {decode:.3f} s ({rate})")
    if args.parity is None:
        return 0
    from ...runtime.generate import TOLERANCES, History, StepResult, read_config
    from ...runtime.parity import hf_logits, load_hf, parity, recorded_source

    history = gen.history
    if hasattr(gen, "plan"):  # runtime/lite: its numpy logits as the torch path's history
        import torch

        history = History(history.prompt, [StepResult(s.token, torch.from_numpy(s.logits), s.position, s.seconds)
                                           for s in history.steps])
    tol = args.tol if args.tol is not None else TOLERANCES[_dtype(gen)]
    try:
        checkpoint, layers = (recorded_source(read_config(model_dir).pagedkit, model_dir) if args.parity == ""
                              else (Path(args.parity), None))
        ref = hf_logits(load_hf(checkpoint, layers), history.token_ids)
        report = parity(history, ref, tol)
    except (OSError, ValueError) as exc:
        return report_error("paged-run: --parity", exc)
    print(f"parity vs Hugging Face eager float32 ({checkpoint}), teacher-forced over the same tokens:")
    print("\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
