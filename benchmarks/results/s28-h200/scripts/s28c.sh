export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; nproc; uptime
timeout 570 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-fast=airbench94_muon.py --runs 8 --seeds 5 \
  --variant '{"size_schedule": ["24:3"], "epochs": 8.0}' \
  --variant '{"size_schedule": ["24:3"], "epochs": 8.0, "tune_kernels": true}' \
  --variant '{"size_schedule": ["24:3"], "epochs": 7.8, "tune_kernels": true}' \
  --variant '{}' \
  --out $OUT/call3_airbench94_vs_cifar10_fast.json 2>&1 | grep -v Warn | cut -c1-600 | tail -12
uptime
