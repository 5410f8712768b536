#!/usr/bin/env bash
# Issue 7 (c), third call: the code before this session's changes ("head", commit ec4af69,
# carried as .carry/src_head/src) against the working tree, which reads on into the next
# epoch, starts the first epoch's pipeline before the warm-up and splits each nVJPEG batch
# among DECODE_LANES handles (LANES=n overrides nvjpeg.DECODE_LANES for one run). In-memory
# references for both compile modes first (MEMORY=0: none; the folder is made once per
# machine). RUNS: key:code:lanes:mode items, run in order.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
[ -d /tmp/imagenet/folder ] || { S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"; }
[ "${MEMORY:-1}" = 0 ] || { S=$(date +%s); timeout 240 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default reduce-overhead --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"; }
grep -i "img/s\|images_per" $R/memory.log | tail -3 | cut -c1-200
NEW=$PWD/src:$PWD/benchmarks
HEAD=$PWD/.carry/src_head/src:$PWD/benchmarks
run() {  # KEY CODE LANES MODE
  local key=$1 code=$2 lanes=$3 mode=$4 S=$(date +%s)
  rm -rf /tmp/imagenet/run-$key
  PYTHONPATH=$code LANES=$lanes timeout 120 python3 -c "
import os, sys
if os.environ.get('LANES') != '0':
    import gpuaccel.data.nvjpeg as n; n.DECODE_LANES = int(os.environ['LANES'])
from gpuaccel.cli import main; sys.exit(main(sys.argv[1:]))" train --data /tmp/imagenet/folder --loader stream --model resnet50 --image-size 224 --precision bf16 --compile --compile-mode $mode --batch-size 256 --eval-batch-size 256 --lr 0.1 --epochs 8 --quiet --run-dir /tmp/imagenet/run-$key > $R/$key.log 2>&1
  echo "$key rc $? $(( $(date +%s)-S ))s"
  cp /tmp/imagenet/run-$key/summary.json $R/summary_$key.json 2>/dev/null
  cp /tmp/imagenet/run-$key/metrics.jsonl $R/metrics_$key.jsonl 2>/dev/null
  python3 -c "
import json; s=json.load(open('$R/summary_$key.json')); m=[json.loads(l) for l in open('$R/metrics_$key.jsonl')]
print('  ', s['images_per_second'], s['test_loss'], 'epochs', [round(r['images_per_second']) for r in m], 'wait', [r['data_wait'] for r in m])" 2>/dev/null
}
for spec in ${RUNS:-head_r1:head:0:default new4_r1:new:4:default new1_r1:new:1:default new4ro_r1:new:4:reduce-overhead head_r2:head:0:default new4_r2:new:4:default new4ro_r2:new:4:reduce-overhead new1_r2:new:1:default}; do
  IFS=: read key code lanes mode <<< "$spec"
  run $key $([ $code = head ] && echo $HEAD || echo $NEW) $lanes $mode
done
