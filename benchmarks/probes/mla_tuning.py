"""Tile sweep of the fused MLA (LATENT) kernel (pagedkit/kernels/triton/mla.py) on the H200: the attention only
(the cache written once beforehand), CUDA-graph replays, over block_n x num_warps x num_stages x num_splits, plus
the launcher's own choice and the general kernel (decode.paged_decode, the 576 channels padded to 1024) on the
same inputs. Prints TB/s against 4.4 (and TFLOP/s against 790); writes $OUT/mla_tuning.json (or ./).

    PYTHONPATH=$PWD python3 benchmarks/probes/mla_tuning.py [ROW,ROW... [--auto-only]]    # default: every mla row
"""
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared helpers
import torch  # noqa: E402

import _attention_cases as C  # noqa: E402
from _timing import time_graph  # noqa: E402
from pagedkit.kernels.triton import common, decode, mla, paged  # noqa: E402

dev = torch.device("cuda")


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else [n for n, c in C.CASES.items() if c.latent]
    auto_only = "--auto-only" in sys.argv  # the launcher's choice and the general kernel, no sweep
    res = {}
    for name in names:
        case = C.CASES[name]
        x, attrs, outputs = C.build_inputs(case, dev)
        mla.paged_attention(x, outputs=outputs, validate=False, **attrs)  # writes the step's latent rows
        a = paged._DEFAULTS | attrs
        kf = common.side_format(x["key_cache"], a["k_cache_dtype"], a["k_quant_type"], "key_cache")
        ks = common.static_scale_vector(x.get("k_scale"), 1, case.head_size)
        q = x["query"].view(-1, case.num_heads, case.head_size)
        kv = max(case.contexts)
        common_kw = dict(key_cache=x["key_cache"], k_format=kf,
                         cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
                         block_table=x["block_table"], num_heads=case.num_heads,
                         head_size=case.head_size, v_head_size=case.v_head, scale=float(a["scale"]), k_scale=ks,
                         k_scale_cache=x.get("k_scale_cache"), max_query_len=1, max_kv_len=kv)
        traffic = C.traffic(case)["total"]
        flops = C.flops(case)
        row = {"floor_ms": C.floor_ms(traffic), "compute_floor_ms": C.compute_floor_ms(flops), "configs": []}

        def record(label, ms, **cfg):
            tb = C.effective_tb_s(traffic, ms)
            tf = flops / (ms * 1e-3) / 1e12
            row["configs"].append({"label": label, "ms": ms, "tb_s": tb, "tflop_s": tf, **cfg})
            print(f"{name} {label} {cfg} {ms:.4f} ms {tb:.2f} TB/s {tf:.0f} TFLOP/s", flush=True)

        record("auto", time_graph(lambda: mla.mla_decode(q, **common_kw)))
        ref = mla.mla_decode(q, **common_kw)

        def general():
            return decode.paged_decode(
                q, key_cache=x["key_cache"], value_cache=None, k_format=kf, v_format=None,
                cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"],
                block_table=x["block_table"], num_heads=case.num_heads, kv_num_heads=1, head_size=case.head_size,
                v_head_size=case.v_head, scale=float(a["scale"]), k_scale=ks, v_scale=ks,
                k_scale_cache=x.get("k_scale_cache"), v_scale_cache=x.get("k_scale_cache"), max_query_len=1,
                max_kv_len=kv)[0]

        try:
            gen = general()
            row["parity_vs_general"] = float((ref.float() - gen.float()).abs().max() / gen.float().abs().max())
            record("general kernel (decode.paged_decode)", time_graph(general))
        except Exception as exc:  # noqa: BLE001 - recorded
            row["general_error"] = " ".join(str(exc).split())[:300]
            print(name, "general kernel:", row["general_error"], flush=True)
        if auto_only:
            res[name] = row
            continue
        sweep = itertools.product((16, 32, 64), (4, 8), (1, 2, 3), (2, 4, 8, 16))
        for bn, warps, stages, splits in sweep:
            if bn > case.block_size:
                continue
            try:
                ms = time_graph(lambda: mla.mla_decode(q, num_splits=splits, block_n=bn, num_warps=warps,
                                                       num_stages=stages, **common_kw))
            except Exception as exc:  # noqa: BLE001 - out of resources: recorded
                row["configs"].append({"label": "sweep", "block_n": bn, "num_warps": warps, "num_stages": stages,
                                       "num_splits": splits, "error": " ".join(str(exc).split())[:200]})
                continue
            record("sweep", ms, block_n=bn, num_warps=warps, num_stages=stages, num_splits=splits)
        ok = [c for c in row["configs"] if "ms" in c and c["label"] != "general kernel (decode.paged_decode)"]
        row["best"] = min(ok, key=lambda c: c["ms"])
        res[name] = row
        print(f"== {name}: best {row['best']}", flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "mla_tuning.json")
    with open(out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "commit": os.environ.get("PAGEDKIT_COMMIT"), "rows": res}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
