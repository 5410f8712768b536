# session 29, call 8: FastNet pooling through gpuaccel's Triton max-pool kernels; before/after on one machine
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 300 python3 benchmarks/redesign_speed.py --old .carry/s29start/src --new src --parts cifar10 --cifar10 /tmp/data/cifar10 \
  --seeds 6 --out $OUT/call8_before_after.json 2>&1 | grep -v Warn | cut -c1-400
python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --profile --run-dir /tmp/prof --json > $OUT/call8_profiled_run.json 2> /tmp/prof.err
python3 benchmarks/trace_gaps.py /tmp/prof/profile/trace.json --out $OUT/call8_step_kernels.json | python3 -c "import json,sys; d=json.load(sys.stdin); [print(k, json.dumps(d[k])[:1500]) for k in ('steps','gpu_window_ms','gpu_ms_per_step_by_kind','top_kernels_ms_per_step')]"
