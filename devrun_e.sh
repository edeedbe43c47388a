mkdir -p /tmp/m
test -d /tmp/m/llama1b || (cd benchmarks && python3 -c "from pathlib import Path; from engine_ort_parity import make_model; make_model(Path('/tmp/m/llama1b-config'), Path('/tmp/m/llama1b'), 0)") > $OUT/make.log 2>&1
PAGEDKIT_COMMIT=$(cat .commit) timeout 420 python3 benchmarks/step_profile.py /tmp/m/llama1b --rows 1x1024 1x4096 8x1024 8x4096 32x4096 --sweep pdl pdl+late pdl132 pdl264 pdl528 pdl132+late --out $OUT/step_profile.json 2>&1 | grep "==\|sweep"
