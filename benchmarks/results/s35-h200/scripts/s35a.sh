# session 35: end to end from JPEG files at batch 512 (ResNet-50, 224 px, bf16, compiled), with probes
# (s35_probes.py), and the in-memory step on the same machine.
# STEPS: mem:VARIANT (in memory, resnet50_kernels.py), or an end-to-end run named by its tokens (below)
set -uo pipefail
export GPUACCEL_CACHE_DIR=/tmp/gpuaccel-cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
export PYTHONPATH=$PWD/src:$PWD/benchmarks
R=$OUT/r; mkdir -p $R
finish() { du -sh /tmp/inductor > $R/inductor_size.txt 2>&1; tar czf $OUT/r.tgz -C $OUT r; }
trap finish EXIT
START=$(date +%s); LIMIT=${LIMIT:-585}
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; nproc; } | tee -a $R/machine.txt
if [[ -f .carry/inductor.tgz && ! -d /tmp/inductor ]]; then tar xzf .carry/inductor.tgz -C /tmp; echo "inductor cache carried"; fi
if [[ ! -d /tmp/imagenet/folder ]]; then
  S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --classes 1000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
fi
e2e() {  # e2e KEY SECONDS [extra train args]
  local key=$1 limit=$2; shift 2
  rm -rf /tmp/imagenet/run-$key
  COUNTERS=$R/counters_$key.json STEPLOG=$R/steps_$key.json timeout $limit python3 .carry/scripts/s35_probes.py \
    train --data /tmp/imagenet/folder --loader stream --model resnet50 --image-size 224 --precision bf16 --compile \
    --batch-size 512 --eval-batch-size 512 --lr 0.1 --epochs ${EPOCHS:-8} --quiet \
    --run-dir /tmp/imagenet/run-$key "$@" > $R/$key.log 2>&1
  echo "$key rc $?"
  grep -iE "error|Traceback|HIPRIO|AFFINITY|step graph|CUDA graph" $R/$key.log | head -5 | cut -c1-240
  cp /tmp/imagenet/run-$key/summary.json $R/summary_$key.json 2>/dev/null
  cp /tmp/imagenet/run-$key/metrics.jsonl $R/metrics_$key.jsonl 2>/dev/null
  python3 -c "
import json, statistics as st; s=json.load(open('$R/summary_$key.json')); m=[json.loads(l) for l in open('$R/metrics_$key.jsonl')]
steps=json.load(open('$R/steps_$key.json'))[-150:]
print('  ', s['images_per_second'], 'train', s['train_seconds'], 'warmup', s['warmup_seconds'], 'wait', [r['data_wait'] for r in m], 'epochs', [r.get('images_per_second') for r in m], 'host step ms median', round(1e3*st.median(steps),1))" 2>/dev/null
}
memory() {  # memory SECONDS VARIANT
  S=$(date +%s); python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants $2 \
    --timeout $1 --work $R/memory_$2 --out $R/memory_$2.json 2>&1 | grep variant | cut -c1-300; echo "memory $2 $(( $(date +%s)-S ))s"
}
for step in ${STEPS}; do
  left=$(( LIMIT - ($(date +%s) - START) ))
  if (( left < 60 )); then echo "$step skipped: $left s left"; continue; fi
  S=$(date +%s)
  if [[ $step == mem:* ]]; then memory $left ${step#mem:}; continue; fi
  # tokens joined by "_": old (code at the session's start) ro (reduce-overhead: the step graph) rot (the step
  # graph, tuned kernels) tuned; nodecode hiprio aff thr2 cpuNN (share NN%, cpu100 all) wN (workers) prod sw
  envs=(); args=(--compile-mode default)
  for token in ${step//_/ }; do
    case $token in
      old) envs+=(PYTHONPATH=$PWD/.carry/s35start/src:$PWD/benchmarks) ;;
      ro) args+=(--compile-mode reduce-overhead) ;;
      rot) args+=(--compile-mode reduce-overhead --tune-kernels) ;;
      tuned) args+=(--compile-mode tuned) ;;
      nodecode) envs+=(NODECODE=1) ;;
      hiprio) envs+=(HIPRIO=1) ;;
      aff) envs+=(AFFINITY=4) ;;
      thr2) envs+=(THREADS=2) ;;
      prod) envs+=(PRODLOG=$R/prod_$step.json) ;;
      sw) envs+=(SWITCH=0.0005) ;;
      cpu100) args+=(--cpu-decode 1.0) ;;
      cpu[0-9]*) args+=(--cpu-decode 0.${token#cpu}) ;;
      w[0-9]*) args+=(--workers ${token#w}) ;;
      r[0-9]*) ;;  # a repeat's tag
    esac
  done
  ( for e in "${envs[@]}"; do export "$e"; done; e2e $step $left "${args[@]}" )
  [[ -f $R/prod_$step.json ]] && python3 -c "
import json, statistics as st; p=json.load(open('$R/prod_$step.json'))
print('   prod ms median/p90/mean', {k: (round(1e3*st.median(v),1), round(1e3*sorted(v)[int(.9*len(v))],1), round(1e3*st.mean(v),1)) for k, v in p.items() if v})"
  echo "  $step $(( $(date +%s)-S ))s"
done
if [[ -n "${SAVE_INDUCTOR:-}" ]]; then tar czf $OUT/inductor.tgz -C /tmp inductor; ls -la $OUT/inductor.tgz; fi
