# session 29, call 7 (same machine as call 6, right after it): cifar10-accurate's side of the comparison
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1; uptime
timeout 400 python3 benchmarks/tune_recipe.py --recipe cifar10-accurate --data /tmp/data/cifar10 --seeds 3 --first-seed 1 \
  --variant '{}' --variant '{"size_schedule": ["24:8"], "epochs": 33}' --out $OUT/call7_cifar10_accurate_same_machine.json 2>&1 | grep -v Warn | cut -c1-300
