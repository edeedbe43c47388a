"""Tile sweep of the Triton decode kernel on the H200 (results: benchmarks/results/attention_tuning.json): times
write_kv and paged_decode separately (CUDA-graph replays) over block_n x num_warps x num_splits per row.
Run on the device: PYTHONPATH=$PWD python3 benchmarks/probes/attention_tuning.py [ROW,ROW...]."""
import itertools, json, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: the shared helpers
import torch
import _attention_cases as C
import _timing
from pagedkit.kernels.triton import common, ops, paged, decode, cache_write
from pagedkit.kernels.attention_math import default_scale

dev = torch.device("cuda")

def time_graph(fn, reps=30, batches=5):
    return _timing.time_graph(fn, reps, batches)

names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fp16-b16-ctx4k-bs256", "fp16-b16-ctx4k-bs16", "int8-b16-ctx4k-bs16", "fp16-b64-ctx8k-bs256", "fp16-b64-ctx8k-bs16", "fp16-b1-ctx32k-bs16", "int4-channel-b64-ctx8k-bs16"]
res = {}
for name in names:
    case = C.CASES[name]
    x, attrs, outputs = C.build_inputs(case, dev)
    a = paged._DEFAULTS | attrs
    fl = C.floor_ms(C.traffic(case)["total"])
    full = lambda: paged.paged_attention(x, outputs=outputs, validate=False, **attrs)
    t_full = time_graph(full)
    nh, hkv = int(a["num_heads"]), int(a["kv_num_heads"]); d = case.head_size
    kf = common.side_format(x["key_cache"], a["k_cache_dtype"], a["k_quant_type"], "key_cache")
    vf = common.side_format(x["value_cache"], a["v_cache_dtype"], a["v_quant_type"], "value_cache")
    ks = common.static_scale_vector(x.get("k_scale"), hkv, d) if kf.scale in (1, 2) else None
    vs = common.static_scale_vector(x.get("v_scale"), hkv, d) if vf.scale in (1, 2) else None
    q = cache_write.write_kv(x["query"], x.get("key"), x.get("value"), num_heads=nh, kv_num_heads=hkv, head_size=d,
        cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"], block_table=x["block_table"],
        key_cache=x["key_cache"], value_cache=x["value_cache"], k_format=kf, v_format=vf, k_scale=ks, v_scale=vs,
        k_scale_cache=x.get("k_scale_cache"), v_scale_cache=x.get("v_scale_cache"),
        cos_cache=x.get("cos_cache") if int(a["do_rotary"]) else None, sin_cache=x.get("sin_cache") if int(a["do_rotary"]) else None,
        qk_rotation=bool(int(a["qk_rotation"])), v_rotation=bool(int(a["v_rotation"])))
    wk = lambda: cache_write.write_kv(x["query"], x.get("key"), x.get("value"), num_heads=nh, kv_num_heads=hkv, head_size=d,
        cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"], block_table=x["block_table"],
        key_cache=x["key_cache"], value_cache=x["value_cache"], k_format=kf, v_format=vf, k_scale=ks, v_scale=vs,
        k_scale_cache=x.get("k_scale_cache"), v_scale_cache=x.get("v_scale_cache"),
        cos_cache=x.get("cos_cache") if int(a["do_rotary"]) else None, sin_cache=x.get("sin_cache") if int(a["do_rotary"]) else None,
        qk_rotation=bool(int(a["qk_rotation"])), v_rotation=bool(int(a["v_rotation"])))
    t_write = time_graph(wk)
    meta = x.get("attention_metadata")
    mq, mkv = (int(v) for v in meta.tolist()[:2]) if meta is not None else (0, 0)
    def dec(**kw):
        return decode._paged_decode(q, key_cache=x["key_cache"], value_cache=x["value_cache"], k_format=kf, v_format=vf,
            cumulative_sequence_length=x["cumulative_sequence_length"], past_seqlens=x["past_seqlens"], block_table=x["block_table"],
            num_heads=nh, kv_num_heads=hkv, head_size=d, v_head_size=d, scale=default_scale(float(a["scale"]), d),
            k_scale=ks, v_scale=vs, k_scale_cache=x.get("k_scale_cache"), v_scale_cache=x.get("v_scale_cache"),
            query_positions=None, softcap=0.0, local_window_size=int(a["local_window_size"]), is_causal=True,
            head_sink=x.get("head_sink"), attention_bias=None, qk_output=0, v_rotation=bool(int(a["v_rotation"])),
            max_query_len=mq, max_kv_len=mkv, **kw)
    ref = dec(num_splits=None)[0].float()
    t_dec = time_graph(lambda: dec(num_splits=None))
    row = {"floor_ms": fl, "full_ms": t_full, "write_ms": t_write, "decode_ms": t_dec, "sweep": []}
    print(f"{name}: floor {fl:.4f} full {t_full:.4f} write {t_write:.4f} decode {t_dec:.4f}", flush=True)
    B = case.batch
    base_s = max(1, -(-264 // (B * hkv)))
    configs = [(bn, nw, sm) for bn in (32, 64, 128) for nw in (4, 8) for sm in (1, 2, 4)] + [(16, 4, 1), (16, 4, 4), (16, 2, 4)]
    for bn, nw, sm in configs:
        S = base_s * sm
        try:
            kw = dict(num_splits=S, block_n=bn, num_warps=nw)
            o = dec(**kw)[0].float()
            err = float((o - ref).abs().max() / ref.abs().max())
            t = time_graph(lambda: dec(**kw), reps=20, batches=3)
        except Exception as e:
            print("  fail", bn, nw, S, str(e)[:100]); continue
        row["sweep"].append({"block_n": bn, "num_warps": nw, "splits": S, "ms": t, "err": err})
    row["sweep"].sort(key=lambda r: r["ms"])
    for r in row["sweep"][:6]:
        print("   ", r, flush=True)
    res[name] = row
out = os.environ.get("OUT", "/tmp")
json.dump(res, open(os.path.join(out, "tune.json"), "w"), indent=1)
