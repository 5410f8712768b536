# session 30, call 1 (a fresh machine): airbench96_faster as published, alone, 3 runs: its first run compiles (max-autotune) into an inductor cache that stays on this machine for call 2
export PYTHONPATH=src PYTHONUNBUFFERED=1 GPUACCEL_CACHE_DIR=$PWD/.gpucache/gpc TORCHINDUCTOR_CACHE_DIR=$PWD/.gpucache/inductor
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; hostname
timeout 585 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-accurate=airbench96_faster.py --runs 3 --seeds 0 \
  --out $OUT/call1_airbench96_alone.json 2>&1 | grep -v Warn | cut -c1-600
du -sh .gpucache/*
