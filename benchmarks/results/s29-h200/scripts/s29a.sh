# session 29, call 1: cifar10-accurate with progressive resizing, 5 seeds each
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 560 python3 benchmarks/tune_recipe.py --recipe cifar10-accurate --data /tmp/data/cifar10 --seeds 5 --first-seed 1 \
  --variant '{}' --variant '{"size_schedule": ["24:8"], "epochs": 32}' --variant '{"size_schedule": ["24:8"], "epochs": 33}' \
  --variant '{"size_schedule": ["24:8"], "epochs": 34}' \
  --out $OUT/call1_cifar10_accurate_variants.json 2>&1 | grep -v Warn | cut -c1-300
