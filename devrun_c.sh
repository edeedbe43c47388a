mkdir -p /tmp/m
(cd benchmarks && python3 -c "from pathlib import Path; from engine_ort_parity import make_model; make_model(Path('/tmp/m/llama1b-config'), Path('/tmp/m/llama1b'), 0)") > $OUT/make.log 2>&1
PAGEDKIT_COMMIT=$(cat .commit) timeout 420 python3 benchmarks/step_profile.py /tmp/m/llama1b --rows 1x1024 8x1024 8x4096 32x4096 --sweep cublas cublas+pdl skinny+pdl t16x512x3x4 t16x512x3x4+pdl t32x512x3x4+pdl t16x256x4x4+pdl t16x1024x2x8+pdl --out $OUT/step_profile.json 2>&1 | grep "==\|sweep"
