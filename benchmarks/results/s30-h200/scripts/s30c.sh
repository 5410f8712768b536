# session 30, call 3 (the same machine, right after call 2): target 2 in one command: cifar10-accurate first (3 seeds), then airbench96_faster with torch.compile default mode, 4 runs each (the first not timed)
export PYTHONPATH=src PYTHONUNBUFFERED=1 GPUACCEL_CACHE_DIR=$PWD/.gpucache/gpc TORCHINDUCTOR_CACHE_DIR=$PWD/.gpucache/inductor
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; hostname
timeout 590 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-accurate=airbench96_faster.py --order gpuaccel-first --airbench-compile default \
  --runs 4 --seeds 3 --out $OUT/call3_cifar10_accurate_vs_airbench96_default_mode.json 2>&1 | grep -v Warn | cut -c1-600
