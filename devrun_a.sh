set -x
python3 -c "import triton; from triton.backends.nvidia.compiler import CUDAOptions as O; print(triton.__version__, 'launch_pdl' in O.__dataclass_fields__)"
mkdir -p /tmp/m
(cd benchmarks && python3 -c "from pathlib import Path; from engine_ort_parity import make_model; make_model(Path('/tmp/m/llama1b-config'), Path('/tmp/m/llama1b'), 0)") > $OUT/make.log 2>&1
tail -2 $OUT/make.log
PAGEDKIT_COMMIT=$(cat .commit) timeout 380 python3 benchmarks/step_profile.py /tmp/m/llama1b --rows 1x1024 8x1024 8x4096 32x4096 --sweep pdl s2 s4 pdl+s2 32x4 128x4 64x2 @1.5 @6 --out $OUT/step_profile.json 2>&1 | tail -60
