# session 33 calls 4, 5 and 7 (MODE=default, variant fused-bn-gram; nodecode_* runs decode each loader's first batch only, common.sh): end to end from JPEG files at batch 512 in the tuned compile mode, against the in-memory step on the same machine
# (the e2e command of benchmarks/results/imagenet-throughput-h200/per-image-taps with --batch-size 512 --eval-batch-size 512 --compile-mode tuned)
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
START=$(date +%s)
{ date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
if [[ ! -d /tmp/imagenet/folder ]]; then
  S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --classes 1000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
fi
memory() {
  S=$(date +%s); python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants ${VARIANT:-fused-bn-gram-tuned} \
    --timeout $1 --work $R/memory_$2 --out $R/memory_$2.json 2>&1 | grep variant | cut -c1-300; echo "memory $2 $(( $(date +%s)-S ))s"
}
for step in ${STEPS}; do
  left=$(( 585 - ($(date +%s) - START) ))
  if (( left < 60 )); then echo "$step skipped: $left s left"; continue; fi
  case $step in
    mem*) memory $left $step ;;
    nodecode*) S=$(date +%s); NODECODE=1 e2e $step $left --epochs 8 --quiet --batch-size 512 --eval-batch-size 512 --compile-mode ${MODE:-tuned}; report $step; echo "  $(( $(date +%s)-S ))s" ;;
    *) S=$(date +%s); e2e $step $left --epochs 8 --quiet --batch-size 512 --eval-batch-size 512 --compile-mode ${MODE:-tuned}; report $step; echo "  $(( $(date +%s)-S ))s" ;;
  esac
done
