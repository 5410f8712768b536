export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 260 python3 benchmarks/tune_recipe.py --recipe cifar10-fast --data /tmp/data/cifar10 --seeds 10 --first-seed 1 \
  --variant '{"size_schedule": null, "epochs": 7.6}' --variant '{"epochs": 8.2}' --variant '{"epochs": 8.4}' \
  --variant '{"size_schedule": ["28:4"], "epochs": 8.0}' \
  --out $OUT/call6_cifar10_fast_variants.json 2>&1 | grep -v Warn | cut -c1-300
timeout 300 python3 benchmarks/redesign_speed.py --old .carry/s28start/src --new src --parts cifar10 resnet50 \
  --cifar10 /tmp/data/cifar10 --seeds 3 --repeats 2 --out $OUT/call6_before_after.json 2>&1 | grep -v Warn | tail -8 | cut -c1-400
