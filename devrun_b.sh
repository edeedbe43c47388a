timeout 420 python3 benchmarks/skinny_probe.py --out $OUT/skinny_probe.json 2>&1 | grep -v Warning | tail -20
