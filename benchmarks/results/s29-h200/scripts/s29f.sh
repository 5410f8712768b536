# session 29, call 6: cifar10-accurate against airbench96_faster as published, side by side; the recipe and 24:8 at 33 epochs
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 590 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-accurate=airbench96_faster.py --runs 3 --seeds 3 \
  --variant '{}' --variant '{"size_schedule": ["24:8"], "epochs": 33}' \
  --out $OUT/call6_airbench96_vs_cifar10_accurate.json 2>&1 | grep -v Warn | cut -c1-600
