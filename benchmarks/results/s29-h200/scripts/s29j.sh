# session 29, call 10 (same machine as calls 8-9): the whole warm command four times; the pooling GPU test
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
for i in 1 2 3 4; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > $OUT/call10_run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i; python3 -c "import json; s=json.load(open('$OUT/call10_run$i.json')); print(s['test_accuracy'], s['train_seconds'], s['phases'])"; done
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py -k "max_pool or pool" 2>&1 | tail -3
