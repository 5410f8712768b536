#!/usr/bin/env bash
# The second call on the same warm machine as stream_run1.sh: CUDA graphs (reduce-overhead)
# with the training loop on a stream of its own or on the default stream, and one more
# default-mode run on its own stream; then the training and streaming tests on the GPU.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
[ -d /tmp/imagenet/folder ] || { echo "no data: machine was released"; exit 3; }
for k in ro_own_r1 ro_default_r1 ro_own_r2 own_r2; do
  S=$(date +%s)
  case $k in
    ro_own*) e2e $k 150 --epochs 8 --quiet --compile-mode reduce-overhead;;
    ro_default*) GPUACCEL_TRAIN_STREAM=default e2e $k 150 --epochs 8 --quiet --compile-mode reduce-overhead;;
    own*) e2e $k 130 --epochs 8 --quiet;;
  esac
  python3 -c "import json; s=json.load(open('$R/summary_$k.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null
  grep -o '"data_wait": [0-9.]*' $R/metrics_$k.jsonl 2>/dev/null | tr '\n' ' '; echo "  $(( $(date +%s)-S ))s"
done
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_stream.py 2>&1 | tail -3 > $R/tests_gpu.txt; cat $R/tests_gpu.txt
