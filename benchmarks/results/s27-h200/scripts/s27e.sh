export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
TIMEFORMAT="%R"
run() { tag=$1; shift; w=$( { time "$@" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/$tag --json > /tmp/$tag.json 2> /tmp/$tag.err; } 2>&1 ); python3 -c "
import json; s=json.load(open('/tmp/$tag.json')); p=s['phases']; w=float('$w')
row={'run': '$tag', 'env': '$*', 'command_seconds': w, 'exit_seconds': round(w-sum(p.values()),3), 'accuracy': s['test_accuracy'], 'phases': p}
print(json.dumps(row)); open('$OUT/whole_command.jsonl','a').write(json.dumps(row)+'\n')" | cut -c1-700 || tail -3 /tmp/$tag.err; }
run first env
for k in 1 2 3 4 5; do run warm$k env; done
timeout 420 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-accurate=airbench96_faster.py --runs 3 --seeds 3 --airbench-compile default \
  --out $OUT/call5_airbench96_default_vs_cifar10_accurate.json 2>&1 | grep -v Warn | cut -c1-600 | tail -3
