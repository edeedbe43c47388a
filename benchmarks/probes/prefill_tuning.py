"""Tile sweep of the Triton paged attention kernel on prefill rows (H200): block_m x block_n x num_warps with one
split (the query-chunk lanes fill the SMs), attention only (the cache write timed apart), CUDA-graph replays.
Prints TFLOP/s per config against the 790 TFLOP/s peak; writes $OUT/prefill_tuning.json.

    PYTHONPATH=$PWD python3 benchmarks/probes/prefill_tuning.py [ROW,ROW...]    # default: every prefill row
"""
import itertools
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared helpers
import torch  # noqa: E402

import _attention_cases as C  # noqa: E402
import _timing  # noqa: E402
from pagedkit.kernels.attention_math import default_scale  # noqa: E402
from pagedkit.kernels.triton import cache_write, common, decode, paged  # noqa: E402

dev = torch.device("cuda")


def time_graph(fn, reps=10, batches=5):
    return _timing.time_graph(fn, reps, batches)


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else [n for n, c in C.CASES.items() if c.prefill]
    res = {}
    for name in names:
        case = C.CASES[name]
        x, attrs, outputs = C.build_inputs(case, dev)
        a = paged._DEFAULTS | attrs
        nh, hkv, d = int(a["num_heads"]), int(a["kv_num_heads"]), case.head_size
        kf = common.side_format(x["key_cache"], a["k_cache_dtype"], a["k_quant_type"], "key_cache")
        vf = common.side_format(x["value_cache"], a["v_cache_dtype"], a["v_quant_type"], "value_cache")
        flops = C.flops(case)

        def write():
            return cache_write.write_kv(
                x["query"], x.get("key"), x.get("value"), num_heads=nh, kv_num_heads=hkv, head_size=d,
                cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
                block_table=x["block_table"], key_cache=x["key_cache"], value_cache=x["value_cache"], k_format=kf,
                v_format=vf)

        q = write()
        mq, mkv = (int(v) for v in x["attention_metadata"].tolist()[:2])

        def dec(**kw):
            return decode._paged_decode(
                q, key_cache=x["key_cache"], value_cache=x["value_cache"], k_format=kf, v_format=vf,
                cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
                block_table=x["block_table"], num_heads=nh, kv_num_heads=hkv, head_size=d, v_head_size=d,
                scale=default_scale(0.0, d), k_scale=None, v_scale=None, k_scale_cache=None, v_scale_cache=None,
                query_positions=None, softcap=0.0, local_window_size=-1, is_causal=True, head_sink=None,
                attention_bias=None, qk_output=0, v_rotation=False, max_query_len=mq, max_kv_len=mkv, **kw)

        ref = dec(num_splits=None)[0].float()
        t_default = time_graph(lambda: dec(num_splits=None))
        row = {"flops": flops, "write_ms": time_graph(write), "default_ms": t_default,
               "default_tflop_s": flops / t_default / 1e9, "full_ms": time_graph(
                   lambda: paged.paged_attention(x, outputs=outputs, validate=False, **attrs)), "sweep": []}
        print(f"{name}: default {t_default:.3f} ms {row['default_tflop_s']:.1f} TF/s, write {row['write_ms']:.3f} ms, "
              f"full call {row['full_ms']:.3f} ms", flush=True)
        for bm, bn, nw, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (None,)):
            kw = dict(num_splits=1, block_m=bm, block_n=bn, num_warps=nw)
            try:
                o = dec(**kw)[0].float()
                err = float((o - ref).abs().max() / ref.abs().max())
                t = time_graph(lambda: dec(**kw), reps=5, batches=3)
            except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (registers, shared memory)
                print("  fail", kw, str(exc)[:120], flush=True)
                continue
            row["sweep"].append({"block_m": bm, "block_n": bn, "num_warps": nw, "ms": t,
                                 "tflop_s": flops / t / 1e9, "err": err})
        row["sweep"].sort(key=lambda r: r["ms"])
        for r in row["sweep"][:5]:
            print("   ", r, flush=True)
        res[name] = row
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "prefill_tuning.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(dev), "rows": res}, fh, indent=1)


if __name__ == "__main__":
    main()
