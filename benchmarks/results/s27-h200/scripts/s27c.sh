export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 470 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-fast=airbench94_muon.py --runs 8 --seeds 5 --variant '{}' \
  --variant '{"inductor": {"coordinate_descent_tuning": true}}' \
  --variant '{"epochs": 7.2, "inductor": {"coordinate_descent_tuning": true}}' \
  --out $OUT/call3_airbench94_vs_cifar10_fast.json 2>&1 | grep -v Warn | cut -c1-600 | tail -5
for r in 1 2 3; do
  S=$(date +%s.%N); TORCH_TRACE=/tmp/trace$r EXITPROBE_LOG=$OUT/exitprobe.log timeout 60 python3 .carry/scripts/exitprobe.py $S -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/probe$r --json > /tmp/probe$r.json 2>/tmp/probe$r.err
  E=$(date +%s.%N); python3 -c "import json; print('wall', $E - $S, json.load(open('/tmp/probe$r.json'))['phases'])" >> $OUT/exitprobe.log
  python3 .carry/scripts/cachelog.py /tmp/trace$r $OUT/cachelog$r.txt
done
tail -c 2500 $OUT/exitprobe.log
