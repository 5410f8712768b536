#!/usr/bin/env bash
# Call 2: call1.sh with a sweep of tile shapes (KERNEL_ARGS) and five end-to-end runs.
# Issue 7 (c): the resampler finishing the batch in one pass (normalised bf16 channels_last,
# three channels per program, column taps held as a tile). Kernel GPU time per batch against
# the previous kernel (.carry/src_head = commit 891b52a), the GPU tests, then end to end A/B
# on one machine (runs alternate), same command as epoch-start/scripts/ab.sh.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
S=$(date +%s); timeout 150 python3 benchmarks/resample_kernel.py /tmp/imagenet/folder --baseline .carry/src_head/src/gpuaccel/data/resample_kernel.py --out $R/resample.json ${KERNEL_ARGS:-} > $R/resample.log 2>&1; echo "resample rc $? $(( $(date +%s)-S ))s"; tail -20 $R/resample.log | cut -c1-200
if [[ -n ${TESTS:-1} ]]; then
  S=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py -x > $R/tests.log 2>&1; echo "tests rc $? $(( $(date +%s)-S ))s"; tail -3 $R/tests.log
fi
if [[ -n ${MEMORY:-1} ]]; then
  S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
  grep -i "img/s\|images_per" $R/memory.log | tail -3 | cut -c1-200
fi
NEW=$PWD/src:$PWD/benchmarks
HEAD=$PWD/.carry/src_head/src:$PWD/benchmarks
report() {
  python3 -c "
import json; s=json.load(open('$R/summary_$1.json')); m=[json.loads(l) for l in open('$R/metrics_$1.jsonl')]
print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'], 'wait', [r['data_wait'] for r in m])" 2>/dev/null
}
for k in ${RUNS:-head_r1 new_r1 new_r2 head_r2 new_r3}; do
  S=$(date +%s)
  if [[ $k == head* ]]; then export PYTHONPATH=$HEAD; else export PYTHONPATH=$NEW; fi
  e2e $k 120 --epochs 8 --quiet
  report $k
  echo "  $(( $(date +%s)-S ))s"
done
