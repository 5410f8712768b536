#!/usr/bin/env bash
# Issue 7 (c) after the faster stem (space-to-depth convolution, Triton max pooling): the
# synthetic folder, the in-memory reference, then two end-to-end runs from the JPEG folder.
# MODE=tuned: gpuaccel's compile mode for both (default: inductor's default); GENERATE=0 reuses
# the folder of an earlier call on the same machine.
set -uo pipefail
MODE=${MODE:-default}
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
if [ "${GENERATE:-1}" != 0 ]; then
  S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
fi
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes $MODE --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
grep -i "img/s\|images_per" $R/memory.log | tail -4 | cut -c1-200
for k in r1 r2; do
  S=$(date +%s)
  e2e ${MODE}_$k 300 --epochs 8 --quiet --compile-mode $MODE
  python3 -c "import json; s=json.load(open('$R/summary_${MODE}_$k.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null
  echo "  $(( $(date +%s)-S ))s"
done
