#!/usr/bin/env bash
# End to end from the JPEG folder: the direct nvJPEG call given the default stream while the
# training loop runs on its own (new default), against the decoder on the loader's stream
# (SIDE_DECODE=1) and everything on the default stream (GPUACCEL_TRAIN_STREAM=default);
# then CUDA graphs with the new default; then the GPU tests of the streaming loader.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; } | tee $R/machine.txt
S=$(date +%s); timeout 100 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
# SIDE_DECODE=1: a sitecustomize that drops the stream argument of the direct call, so it decodes on
# the loader's stream as before this commit
mkdir -p /tmp/side_decode && cat > /tmp/side_decode/sitecustomize.py <<'PY'
import gpuaccel.data.nvjpeg as n
_decode = n.BatchDecoder.decode
n.BatchDecoder.decode = lambda self, *args, stream=None: _decode(self, *args[:5])
PY
run() {
  local k=$1; S=$(date +%s)
  case $k in
    new*) e2e $k 130 --epochs 8 --quiet;;
    side*) PYTHONPATH=/tmp/side_decode:$PYTHONPATH e2e $k 130 --epochs 8 --quiet;;
    trdefault*) GPUACCEL_TRAIN_STREAM=default e2e $k 130 --epochs 8 --quiet;;
    ro_new*) e2e $k 150 --epochs 8 --quiet --compile-mode reduce-overhead;;
  esac
  python3 -c "import json; s=json.load(open('$R/summary_$k.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null
  grep -o '"data_wait": [0-9.]*' $R/metrics_$k.jsonl 2>/dev/null | cut -d' ' -f2 | tr '\n' ' '; echo "  $(( $(date +%s)-S ))s"
}
for k in new_r1 side_r1 ro_new_r1; do run $k; done
S=$(date +%s); timeout 150 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
grep "^default\|^baseline" $R/memory.log | cut -c1-120
run new_r2
