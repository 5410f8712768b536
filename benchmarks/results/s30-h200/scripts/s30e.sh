# session 30, call 5 (a fresh machine): the final code's whole command: the first run (Pillow decodes the cache, inductor compiles), then three warm runs; then the test suite with a GPU (the tests CI skips)
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
for i in 1 2 3 4; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > $OUT/call5_run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i; python3 -c "import json; s=json.load(open('$OUT/call5_run$i.json')); print(s['test_accuracy'], s['train_seconds'], s['phases'])"; done
ls /tmp/gpc/datasets/
timeout 330 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tail -4 > $OUT/call5_tests_gpu.log; cat $OUT/call5_tests_gpu.log
