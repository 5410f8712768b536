# session 29, call 12: the final code on a fresh machine: the first run (Pillow decode, compile), then three warm runs
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
for i in 1 2 3 4; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > $OUT/call12_run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i; python3 -c "import json; s=json.load(open('$OUT/call12_run$i.json')); print(s['test_accuracy'], s['train_seconds'], s['phases'])"; done
ls /tmp/gpc/datasets/
python3 -c "import gpuaccel; gpuaccel.load_dataset('/tmp/data/cifar10')"; ls /tmp/gpc/datasets/   # the same single entry: the trainer read Pillow's
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py -k "pool or stem" 2>&1 | tail -2
