python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py tests/test_env.py 2>&1 | tail -4 | tee $OUT/gpu_tests.log
TIMEFORMAT="%R"
run() { tag=$1; shift; w=$( { time python3 -m gpuaccel train "$@" --data /tmp/data/cifar10 --run-dir /tmp/$tag --json > /tmp/$tag.json 2> /tmp/$tag.err; echo "rc=$?" >> /tmp/$tag.err; } 2>&1 ); python3 -c "
import json; s=json.load(open('/tmp/$tag.json')); p=s['phases']; w=float('$w')
row={'run': '$tag', 'args': '$*', 'command_seconds': w, 'exit_seconds': round(w-sum(p.values()),3), 'accuracy': s['test_accuracy'], 'train_seconds': s.get('train_seconds'), 'phases': p}
print(json.dumps(row)); open('$OUT/whole_command.jsonl','a').write(json.dumps(row)+'\n')" | cut -c1-700 || tail -3 /tmp/$tag.err; tail -1 /tmp/$tag.err; }
run first --recipe cifar10-fast
for k in 1 2 3; do run warm$k --recipe cifar10-fast; done
run accurate1 --recipe cifar10-accurate
run accurate2 --recipe cifar10-accurate
run stream1 --loader stream --model resnet18 --epochs 2 --batch-size 512 --compile
run stream2 --loader stream --model resnet18 --epochs 2 --batch-size 512 --compile --compile-mode reduce-overhead
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py 2>&1 | tail -4 | tee -a $OUT/gpu_tests.log
