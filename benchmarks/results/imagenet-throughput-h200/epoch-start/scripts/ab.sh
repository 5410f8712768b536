#!/usr/bin/env bash
# Issue 7 (c): the reader processes going on into the next epoch (PassReader), A/B on one
# machine. "head" runs the code before the change (commit ec4af69, carried as
# .carry/src_head/src), "new" the working tree; runs alternate. Same folder and command as
# fast-stem/scripts/e2e_run.sh (default compile mode). Then two profiled runs (--profile:
# steps 8-12), one streaming and one from GPU-resident data (--loader gpu), each summarised
# by benchmarks/trace_gaps.py.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
grep -i "img/s\|images_per" $R/memory.log | tail -3 | cut -c1-200
for k in ${RUNS:-head_r1 new_r1 head_r2 new_r2 gpu_profile new_profile head_r3 new_r3}; do
  S=$(date +%s)
  if [[ $k == head* ]]; then export PYTHONPATH=$HEAD; else export PYTHONPATH=$NEW; fi
  case $k in
    gpu_profile) e2e $k 150 --epochs 8 --quiet --loader gpu --profile ;;
    new_profile) e2e $k 120 --epochs 8 --quiet --profile ;;
    *) e2e $k 120 --epochs 8 --quiet ;;
  esac
  report $k
  if [[ $k == *profile ]]; then
    python3 benchmarks/trace_gaps.py /tmp/imagenet/run-$k/profile/trace.json --out $R/gaps_$k.json | head -40
    cp /tmp/imagenet/run-$k/profile/ops.txt $R/ops_$k.txt 2>/dev/null
  fi
  echo "  $(( $(date +%s)-S ))s"
done
