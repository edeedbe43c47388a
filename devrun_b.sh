timeout 300 python3 benchmarks/skinny_probe.py --out $OUT/skinny_probe.json 2>&1 | grep -v Warning | tail -20
timeout 120 python3 -m pytest -q -m gpu tests/test_triton_skinny.py 2>&1 | tail -3
