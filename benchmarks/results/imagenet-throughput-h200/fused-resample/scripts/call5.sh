#!/usr/bin/env bash
# Call 5, probes with CUDA graphs (--compile-mode reduce-overhead): nvJPEG writing RGB (as it does)
# or YUV planes (YUV=1: no conversion kernels, colours wrong; this only times it); then the in-memory
# phase of reduce-overhead as the reference.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
report() {
  python3 -c "
import json; s=json.load(open('$R/summary_$1.json')); m=[json.loads(l) for l in open('$R/metrics_$1.jsonl')]
print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'], 'wait', [r['data_wait'] for r in m])" 2>/dev/null
}
for k in ${RUNS:-ro_rgb_r1 ro_yuv_r1 ro_yuv_r2 ro_rgb_r2}; do
  S=$(date +%s)
  case $k in
    ro_yuv*) YUV=1 e2e $k 170 --epochs 8 --quiet --compile-mode reduce-overhead ;;
    ro_rgb*) e2e $k 170 --epochs 8 --quiet --compile-mode reduce-overhead ;;
    new_profile) e2e $k 150 --epochs 8 --quiet --profile ;;
    *) e2e $k 150 --epochs 8 --quiet ;;
  esac
  report $k
  if [[ $k == *profile ]]; then
    python3 benchmarks/trace_gaps.py /tmp/imagenet/run-$k/profile/trace.json --out $R/gaps_$k.json | head -40
  fi
  echo "  $(( $(date +%s)-S ))s"
done
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes reduce-overhead --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
grep -i "img/s\|images_per" $R/memory.log | tail -3 | cut -c1-200
