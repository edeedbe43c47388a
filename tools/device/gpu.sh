#!/usr/bin/env bash
# Stages of the GPU plan of issue 40 (tools/device/README.md says which call runs which, and what to carry).
#   bash tools/device/gpu.sh STAGE [ARGS]
# Everything lands under $OUT (the device tool brings it back); models under /tmp/m, onnxruntime-gpu under
# /tmp/ortgpu. Stages that need a previous one's files say so. Never resets or reconfigures the GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/out}"
M=/tmp/m
mkdir -p "$OUT" "$M"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"

deps() {  # the wheels the image lacks (.whl/, carried), into /tmp/site
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  return 0
}

llama1b() {  # Llama-3.2-1B-shaped export, random weights, fp16, 256-token blocks, context 4096
  [ -f "$M/llama1b/model.onnx" ] && return 0
  mkdir -p "$M/llama1b_cfg"
  python3 -c "import json,sys; sys.path.insert(0,'benchmarks'); from engine_ort_parity import LLAMA_1B as c; \
json.dump(c, open('$M/llama1b_cfg/config.json','w'))"
  python3 -m pagedkit.exporters.cli --model "$M/llama1b_cfg" --output "$M/llama1b" --block-size 256 --quiet
}

dsv2() {  # DeepSeek-V2-Lite at its full shape (27 layers, 64 + 2 experts, top-6), random weights, 64-token blocks;
          # DSV2_DTYPE=fp16 when onnxruntime-gpu refuses the bf16 file (one export at a time: 31 GB of a 64 GB disk)
  local dt="${DSV2_DTYPE:-bf16}"
  [ -f "$M/dsv2full/model.onnx" ] && grep -q "\"$dt\"" "$M/dsv2full/dtype" 2>/dev/null && return 0
  rm -rf "$M/dsv2full"
  python3 -m pagedkit.exporters.cli --model deepseek-v2-lite --dtype "$dt" --block-size 64 --max-seq-len 8192 \
    --output "$M/dsv2full" --quiet && echo "\"$dt\"" > "$M/dsv2full/dtype"
}

ort() {  # unpack onnxruntime-gpu from the parts copied to /tmp/ortc (../shared/tools/ort-gpu.md)
  [ -d /tmp/ortgpu/onnxruntime ] && return 0
  mkdir -p /tmp/ortgpu
  cat /tmp/ortc/part.* | PYTHONPATH=/tmp/zs python3 -c "import sys,zstandard as z; \
z.ZstdDecompressor(max_window_size=2**31).copy_stream(sys.stdin.buffer, sys.stdout.buffer)" | tar x -C /tmp/ortgpu
}

ortenv() { export PYTHONPATH="/tmp/ortgpu:$PYTHONPATH"; }

case "${1:-}" in
  part0)  # first call: the first part, zstandard for unpacking, the background work (setsid: it outlives the call,
          # which returns at its timeout_s: the tool waits on every process otherwise), then the GEMV probe (item 1)
    mkdir -p /tmp/ortc && cp .ortgpu0/part.* /tmp/ortc/
    python3 -m pip install -q --no-index --no-deps --target /tmp/zs .ortgpu0/*.whl
    deps
    setsid nohup bash tools/device/gpu.sh background > /tmp/bg.log 2>&1 < /dev/null &
    python3 benchmarks/probes/gemv_probe.py --bandwidth "${BW:-3.0}" --out "$OUT/gemv_probe.json" 2>&1 \
      | tee "$OUT/gemv_probe.log"
    touch /tmp/probe.done ;;
  background)  # exports (CPU and disk), then, once the probe's timings are done, the full GPU test suite
    rm -f /tmp/bg.done
    (time llama1b) > /tmp/llama1b.log 2>&1
    (time dsv2) > /tmp/dsv2.log 2>&1
    for _ in $(seq 1 600); do [ -f /tmp/probe.done ] && break; sleep 1; done
    python3 -m pytest -q -m gpu -p no:cacheprovider tests > /tmp/gpu_tests.log 2>&1; echo "rc $?" >> /tmp/gpu_tests.log
    touch /tmp/bg.done ;;
  part)  # calls 2..N: one more part
    cp ".ortgpu$2"/part.* /tmp/ortc/; ls -la /tmp/ortc; tail -3 /tmp/*.log ;;
  wait)  # wait for the background work (at most $2 s), then copy its logs back
    for _ in $(seq 1 "${2:-300}"); do [ -f /tmp/bg.done ] && break; sleep 1; done
    cp /tmp/*.log "$OUT"/ 2>/dev/null; tail -5 /tmp/gpu_tests.log /tmp/dsv2.log /tmp/llama1b.log ;;
  bench1b)  # item 1 + 2 + 4: the 1B rows against onnxruntime-gpu (and genai's engine where .ogcuda was carried)
    ort; ortenv; deps
    arms="pagedkit ort"
    if ls .ogcuda/*.whl > /dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/ortgpu .ogcuda/*.whl && arms="$arms genai"
    fi
    llama1b
    # shellcheck disable=SC2086
    python3 -m pagedkit.apps.bench.cli "$M/llama1b" --device cuda --batches 1 8 32 --contexts 1024 4096 \
      --repeats "${2:-3}" --arms $arms --out "$OUT/bench1b" --no-progress 2>&1 | tee "$OUT/bench1b.log" ;;
  benchds)  # item 3: DeepSeek-V2-Lite full shape against onnxruntime-gpu's LATENT path
    ort; ortenv; deps; dsv2
    python3 -m pagedkit.apps.bench.cli "$M/dsv2full" --device cuda --batches 1 8 32 --contexts 1024 4096 \
      --decode-steps 16 --out "$OUT/benchds" --no-progress 2>&1 | tee "$OUT/benchds.log" ;;
  profile)  # the decode step's kernels and the sweeps of item 1 (PAGEDKIT_DECODE_LINEAR=1 for the GEMV rows)
    shift; deps; llama1b
    python3 benchmarks/step_profile.py "$M/llama1b" --rows 1x1024 1x4096 8x1024 8x4096 --top 12 --sweep "$@" \
      --out "$OUT/step_profile.json" 2>&1 | tee "$OUT/step_profile.log" ;;
  profileds)  # DeepSeek-V2-Lite's decode step: where it goes, and the routing kernel against torch's routing
    deps; dsv2
    python3 benchmarks/step_profile.py "$M/dsv2full" --rows 1x1024 8x1024 32x1024 --top 15 --sweep noroute \
      --out "$OUT/step_profile_ds.json" 2>&1 | tee "$OUT/step_profile_ds.log" ;;
  *) echo "usage: gpu.sh part0 | background | part K | wait [S] | bench1b [REPEATS] | benchds | profile SWEEP... |"\
          "profileds"
     exit 2 ;;
esac
