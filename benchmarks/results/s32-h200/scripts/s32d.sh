# session 32 call 4: what the 1x1 kernel's epilogue costs (with and without the statistics), batch 512
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
python3 benchmarks/conv1x1_stats.py --batch 512 --out $OUT/call4_conv1x1_stats.json 2>&1 | tail -1
python3 - <<'PY'
import json,os
d=json.load(open(os.environ["OUT"]+"/call4_conv1x1_stats.json"))
for r in d["rows"]:
    print(r["input"], r["out_channels"], r["stride"], r["count"], *(round(r[k],3) for k in ("ms_conv","ms_stats","ms_triton","ms_triton_without_statistics","ms_triton_pointers","ms_triton_pointers_without_statistics")))
PY
