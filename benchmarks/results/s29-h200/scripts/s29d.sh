# session 29, call 4: where cifar10-fast's step spends its GPU time; fewer Newton-Schulz iterations
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --profile --run-dir /tmp/prof --json > $OUT/call4_profiled_run.json 2> /tmp/prof.err; tail -3 /tmp/prof.err
python3 benchmarks/trace_gaps.py /tmp/prof/profile/trace.json --out $OUT/call4_step_kernels.json | python3 -c "import json,sys; d=json.load(sys.stdin); [print(k, json.dumps(d[k])) for k in ('steps','gpu_window_ms','gpu_busy_share','gpu_ms_per_step_by_kind','top_kernels_ms_per_step')]"
cp /tmp/prof/profile/ops.txt $OUT/call4_ops.txt
timeout 400 python3 benchmarks/tune_recipe.py --recipe cifar10-fast --data /tmp/data/cifar10 --seeds 5 --first-seed 1 \
  --variant '{}' --variant '{"muon_ns_steps": 3}' --variant '{"muon_ns_steps": 4}' \
  --variant '{"muon_ns_steps": 3, "size_schedule": ["28:4"], "epochs": 8.0}' \
  --out $OUT/call4_cifar10_fast_variants.json 2>&1 | grep -v Warn | cut -c1-300
