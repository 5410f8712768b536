# session 29, call 9: cifar10-fast with the Triton pooling against airbench94_muon, side by side
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 560 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-fast=airbench94_muon.py --runs 8 --seeds 5 \
  --variant '{}' --variant '{"muon_ns_steps": 3}' --variant '{"muon_ns_steps": 3, "size_schedule": ["28:4"], "epochs": 8.0}' \
  --out $OUT/call9_airbench94_vs_cifar10_fast.json 2>&1 | grep -v Warn | cut -c1-500
