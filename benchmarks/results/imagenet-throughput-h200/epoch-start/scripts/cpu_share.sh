#!/usr/bin/env bash
# Issue 7 (c), last call: the session's final code end to end (default compile mode), with
# --cpu-decode 0 (the default: nvJPEG decodes every image) against 0.1 and 0.2 (the reader
# processes decode that share with Pillow, taking it off the GPU's decoder), alternated,
# after the in-memory reference on the same machine and the GPU tests of the loaders.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
(PYTHONPATH=src timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py tests/test_loader.py 2>&1 | tail -3) | tee $R/gpu_tests.txt
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
grep -i "img/s\|images_per" $R/memory.log | tail -2 | cut -c1-200
for spec in ${RUNS:-cpu0_r1:0 cpu10_r1:0.1 cpu20_r1:0.2 cpu0_r2:0 cpu10_r2:0.1 cpu0_r3:0}; do
  IFS=: read key share <<< "$spec"
  S=$(date +%s)
  e2e $key 120 --epochs 8 --quiet --cpu-decode $share
  echo "  $(( $(date +%s)-S ))s"
  python3 -c "
import json; s=json.load(open('$R/summary_$key.json')); m=[json.loads(l) for l in open('$R/metrics_$key.jsonl')]
print('  ', s['images_per_second'], s['test_loss'], 'epochs', [round(r['images_per_second']) for r in m], 'wait', [r['data_wait'] for r in m])" 2>/dev/null
done
