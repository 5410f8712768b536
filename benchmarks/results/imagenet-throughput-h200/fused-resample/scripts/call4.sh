#!/usr/bin/env bash
# Call 4, probes: nvJPEG writing YUV planes (no rgba2rgb kernels; the colours are then wrong,
# this only times it) and a deeper queue of batches made ahead (DEPTH=6 instead of 3).
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
report() {
  python3 -c "
import json; s=json.load(open('$R/summary_$1.json')); m=[json.loads(l) for l in open('$R/metrics_$1.jsonl')]
print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'], 'wait', [r['data_wait'] for r in m])" 2>/dev/null
}
for k in ${RUNS:-new_r1 yuv_r1 depth6_r1 new_r2 yuv_r2 depth6_r2}; do
  S=$(date +%s)
  case $k in
    yuv*) YUV=1 e2e $k 150 --epochs 8 --quiet ;;
    depth6*) DEPTH=6 e2e $k 150 --epochs 8 --quiet ;;
    new_profile) e2e $k 150 --epochs 8 --quiet --profile ;;
    *) e2e $k 150 --epochs 8 --quiet ;;
  esac
  report $k
  if [[ $k == *profile ]]; then
    python3 benchmarks/trace_gaps.py /tmp/imagenet/run-$k/profile/trace.json --out $R/gaps_$k.json | head -40
  fi
  echo "  $(( $(date +%s)-S ))s"
done
