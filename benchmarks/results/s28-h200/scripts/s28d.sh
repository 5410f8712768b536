export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 470 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-fast=airbench94_muon.py --runs 10 --seeds 10 --variant '{}' \
  --out $OUT/call4_airbench94_vs_cifar10_fast.json 2>&1 | grep -v Warn | cut -c1-600 | tail -4
uptime
TIMEFORMAT="%R"
run() { tag=$1; shift; w=$( { time timeout 100 python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 "$@" --run-dir /tmp/$tag --json > /tmp/$tag.json 2> /tmp/$tag.err; } 2>&1 ); python3 -c "
import json; s=json.load(open('/tmp/$tag.json')); p=s['phases']; w=float('$w')
row={'run': '$tag', 'args': '$*', 'command_seconds': w, 'exit_seconds': round(w-sum(p.values()),3), 'accuracy': s['test_accuracy'], 'train_seconds': s.get('train_seconds'), 'phases': p}
print(json.dumps(row)); open('$OUT/call4_whole_command.jsonl','a').write(json.dumps(row)+'\n')" | cut -c1-900 || tail -3 /tmp/$tag.err; }
for r in 1 2 3 4; do run cmd$r; done
