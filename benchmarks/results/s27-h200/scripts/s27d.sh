export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
TIMEFORMAT="%R"
run() { tag=$1; shift; w=$( { time "$@" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/$tag --json > /tmp/$tag.json 2> /tmp/$tag.err; } 2>&1 ); python3 -c "
import json; s=json.load(open('/tmp/$tag.json')); p=s['phases']; w=float('$w')
row={'run': '$tag', 'env': '$*', 'command_seconds': w, 'exit_seconds': round(w-sum(p.values()),3), 'accuracy': s['test_accuracy'], 'phases': p}
print(json.dumps(row)); open('$OUT/whole_command.jsonl','a').write(json.dumps(row)+'\n')" | cut -c1-700 || tail -3 /tmp/$tag.err; }
run first env
run second env
run third env
ls /tmp/gpc/inductor/gpuaccel-compiled /tmp/torchinductor_root 2>&1 | head -5
for r in 1 2 3 4; do
  fast=$(( r % 2 ))
  S=$(date +%s.%N); EXITPROBE_FAST=$fast EXITPROBE_LOG=$OUT/exitprobe.log python3 .carry/scripts/exitprobe.py $S -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/probe$r --json > /tmp/probe$r.json 2>/tmp/probe$r.err
  E=$(date +%s.%N); python3 -c "import json; print('wall', $E - $S, 'fast=$fast', json.load(open('/tmp/probe$r.json'))['phases'])" >> $OUT/exitprobe.log
done
grep "wall\|os._exit\|main returned\|shutdown_compile" $OUT/exitprobe.log | cut -c1-200
CD='"inductor": {"coordinate_descent_tuning": true}'
timeout 330 python3 benchmarks/tune_recipe.py --recipe cifar10-fast --data /tmp/data/cifar10 --seeds 5 --first-seed 1 \
  --variant "{$CD}" --variant "{\"epochs\": 7.2, \"label_smoothing\": 0.15, $CD}" --variant "{\"epochs\": 7.2, \"label_smoothing\": 0.2, $CD}" \
  --variant "{\"epochs\": 7.2, \"muon_lr\": 0.24, $CD}" --variant "{\"epochs\": 7.2, \"crop_padding\": 3, $CD}" \
  --variant "{\"epochs\": 7.0, \"batch_size\": 1280, $CD}" --variant "{\"epochs\": 7.2, \"momentum\": 0.9, $CD}" \
  --out $OUT/fast_variants.json 2>&1 | grep -v Warn | cut -c1-300
