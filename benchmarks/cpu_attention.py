"""CPU benchmark: one PagedAttention decode step of a SmolLM2-135M-shaped layer (H 9, Hkv 3, D 64,
block 16, fp16 activations and cache, RoPE over 8192 positions): the loop-based reference vs the
vectorized torch_sdpa variant.

    python benchmarks/cpu_attention.py [--contexts 128 512 2048] [--batches 1 4 8] [--prefill 128 512]
                                       [--threads N] [--no-validate]

Prints, per (batch, context) and kernel: the best wall time and the best process CPU time in milliseconds
over --reps calls (minima are the least disturbed by other load on a shared machine; with --threads 1 the
CPU time also excludes time spent waiting for a core), the speedup (CPU time), and the attention time per
generated token a 30-layer model would spend (torch_sdpa CPU time x 30 / batch). Prefill rows: one
sequence's whole prompt in one call (reference timed once: it is slow); the last column is then per
prompt token. Each call runs on fresh copies of the caches (the copy is outside the timed region).
Numbers are for this machine only.
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedkit.kernels.paged import reference, torch_sdpa as torch_paged

H, HKV, D, BS, LAYERS = 9, 3, 64, 16, 30


def decode_inputs(batch: int, context: int, seed: int = 0, new: int = 1) -> tuple[dict, dict]:
    """A decode step: every sequence holds context - new cached tokens and adds new (a prefill: new = context)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-context // BS)
    num_blocks = batch * blocks_per_seq + 1
    perm = torch.randperm(num_blocks, generator=g)[: batch * blocks_per_seq]
    table = perm.view(batch, blocks_per_seq).to(torch.int32)  # [B, MB] shuffled physical blocks
    angle = torch.rand(8192, D // 2, generator=g) * 6.28  # SmolLM2's max_position_embeddings
    x = {
        "query": torch.randn(batch * new, H * D, generator=g).half(),  # [T, H*D]
        "key": torch.randn(batch * new, HKV * D, generator=g).half(),
        "value": torch.randn(batch * new, HKV * D, generator=g).half(),
        "key_cache": torch.randn(num_blocks, BS, HKV, D, generator=g).half(),  # [NB, BS, Hkv, D]
        "value_cache": torch.randn(num_blocks, BS, HKV, D, generator=g).half(),
        "cumulative_sequence_length": torch.arange(batch + 1, dtype=torch.int32) * new,
        "past_seqlens": torch.full((batch,), context - new, dtype=torch.int32),
        "block_table": table,
        "cos_cache": angle.cos().half(),
        "sin_cache": angle.sin().half(),
    }
    return x, {"num_heads": H, "kv_num_heads": HKV, "do_rotary": 1}


def time_call(fn, x: dict, attrs: dict, reps: int) -> tuple[float, float]:
    """Best wall time and best process CPU time (ms) of fn over reps calls, each on fresh cache copies."""
    wall, cpu = [], []
    for _ in range(reps + 1):
        feed = {k: v.clone() for k, v in x.items()}
        t0, c0 = time.perf_counter(), time.process_time()
        fn(feed, outputs=["output", "key_cache_out", "value_cache_out"], **attrs)
        wall.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.process_time() - c0) * 1e3)
    return min(wall[1:]), min(cpu[1:])  # the first call warms up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--prefill", type=int, nargs="*", default=[128, 512],
                    help="prompt lengths of single-sequence prefill rows after the decode table")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-validate", action="store_true",
                    help="torch_sdpa without the per-call contract validator (a session validates at creation)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"PagedAttention decode steps and prefills, H {H} Hkv {HKV} D {D} block {BS}, fp16; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'batch':>7} {'context':>7} {'reference wall/cpu ms':>22} {'torch_sdpa wall/cpu ms':>23} "
          f"{'speedup':>8} {'30 layers ms/token':>19}")
    rows = [(batch, context, 1) for batch in args.batches for context in args.contexts]
    rows += [(1, prompt, prompt) for prompt in args.prefill]
    for batch, context, new in rows:
        x, attrs = decode_inputs(batch, context, new=new)
        ref = reference.paged_attention({k: v.clone() for k, v in x.items()}, **attrs)["output"]
        got = torch_paged.paged_attention({k: v.clone() for k, v in x.items()}, **attrs)["output"]
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        assert err <= 2e-3, f"torch_sdpa disagrees with the reference: {err:.3g}"
        t_ref = time_call(reference.paged_attention, x, attrs, args.reps if new == 1 else 1)
        t_new = time_call(torch_paged.paged_attention, x, dict(attrs, validate=not args.no_validate), args.reps)
        label = f"{batch:>7} {context:>7}" if new == 1 else f"{'prefill':>7} {context:>7}"
        print(f"{label} {t_ref[0]:>12.2f} / {t_ref[1]:>7.2f} {t_new[0]:>13.2f} / {t_new[1]:>7.2f} "
              f"{t_ref[1] / t_new[1]:>7.1f}x {t_new[1] * LAYERS / (batch * new):>19.2f}")


if __name__ == "__main__":
    main()
