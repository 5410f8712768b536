#!/usr/bin/env bash
# Issue 7 (c): does training on PyTorch's default stream (CUDA's legacy NULL stream) hold up
# nvJPEG's hardware decoder? (1) the decoder beside a CUDA graph replayed on the default stream
# and on a stream of its own; (2) the synthetic folder, in-memory reference, and end-to-end
# runs with the training loop on either stream, alternated.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
for s in default own; do
  timeout 150 python3 benchmarks/nvjpeg_variants.py --backends 3 --flags 0 --formats 3 --load-stream $s --out $R/variants_load_$s.json 2>&1 | grep -v -i warn | tail -2 | cut -c1-300
done
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
grep -i "img/s\|images_per" $R/memory.log | tail -4 | cut -c1-200
for k in default own; do
  S=$(date +%s)
  if [ $k = default ]; then GPUACCEL_TRAIN_STREAM=default e2e ${k}_r1 130 --epochs 8 --quiet; else e2e ${k}_r1 130 --epochs 8 --quiet; fi
  python3 -c "import json; s=json.load(open('$R/summary_${k}_r1.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null
  echo "  $(( $(date +%s)-S ))s"
done
