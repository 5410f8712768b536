#!/usr/bin/env bash
# Issue 7 (c), the resampler finishing the batch in one pass: what every call of this folder ran
# (callN.sh set the variables). In order, each step skipped where its variable is set empty:
#   KERNEL (on)  the kernel's GPU time per batch against head's kernel, with KERNEL_ARGS;
#   TESTS (on)   tests/test_stream.py on the GPU;
#   MEMORY_MODES (default)  the in-memory phase in those compile modes (before the runs);
#   RUNS         end-to-end runs, alternating; the key's prefix picks the code and probe:
#     head_*       commit 891b52a (carried as .carry/src_head/src), new_* this tree,
#     switch1ms_*  SWITCH=0.001, files_* SHARING=file_system, both_* the two,
#     yuv_*        YUV=1 (nvJPEG's YUV planes: a timing probe, colours wrong), depth6_* DEPTH=6,
#     ro_rgb_*, ro_yuv_*  --compile-mode reduce-overhead (without, with YUV=1),
#     new_profile  --profile, summarised by trace_gaps.py (long_profile: 12 steps from step 20),
#     freeze_*, nofreeze_*  this tree with and without the trainer's gc.freeze() (NO_FREEZE=1), each
#                  logging its full garbage collections (GCLOG) to gc_KEY.json;
#     nodecode_*, noresample_*, nogpu_*  this tree with the pipeline's GPU work cut out (NODECODE=1,
#                  NORESAMPLE=1, both): ablations that show what each part costs end to end.
#     own_*        OWNSTREAM=1 (training on a stream of its own, nvJPEG given the default stream);
#     noreserve_*  NORESERVE=1 (nvJPEG's buffers not reserved); threads2_* THREADS=2 (two pipeline threads);
#     every run logs the pipeline thread's time per batch (PRODLOG) to prod_KEY.json.
#   BUDGET (480)  seconds after the start past which no further run begins (a call may run 600 s).
# ../../per-image-taps/ runs it too, with .carry/src_head holding a later commit (named in
# .carry/src_head/COMMIT, copied to machine.txt).
# The probes' hooks are in ../../nvjpeg-wait/scripts/common.sh. The command and folder are those
# of ../../epoch-start/scripts/ab.sh (default compile mode).
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
START=$(date +%s)
{ date -u; cat .carry/commit.txt; cat .carry/src_head/COMMIT 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $R/machine.txt
S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/generate.json > $R/generate.log 2>&1; echo "generate rc $? $(( $(date +%s)-S ))s"
if [[ -n ${KERNEL-1} ]]; then
  S=$(date +%s); timeout 150 python3 benchmarks/resample_kernel.py /tmp/imagenet/folder --baseline .carry/src_head/src/gpuaccel/data/resample_kernel.py --out $R/resample.json ${KERNEL_ARGS:-} > $R/resample.log 2>&1; echo "resample rc $? $(( $(date +%s)-S ))s"; tail -20 $R/resample.log | cut -c1-200
fi
if [[ -n ${TESTS-1} ]]; then
  S=$(date +%s); timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py -x > $R/tests.log 2>&1; echo "tests rc $? $(( $(date +%s)-S ))s"; tail -3 $R/tests.log
fi
if [[ -n ${MEMORY_MODES-default} ]]; then
  S=$(date +%s); timeout 200 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes ${MEMORY_MODES-default} --out $R/memory.json > $R/memory.log 2>&1; echo "memory rc $? $(( $(date +%s)-S ))s"
  grep -i "img/s\|images_per" $R/memory.log | tail -3 | cut -c1-200
fi
for k in ${RUNS:-head_r1 new_r1 head_r2 new_r2}; do
  S=$(date +%s)
  if (( S - START > ${BUDGET:-480} )); then echo "$k skipped: past the budget"; continue; fi
  if [[ $k == head* ]]; then export PYTHONPATH=$HEAD; else export PYTHONPATH=$NEW; fi
  export PRODLOG=$R/prod_$k.json
  case $k in
    switch1ms*) SWITCH=0.001 e2e $k 150 --epochs 8 --quiet ;;
    files*) SHARING=file_system e2e $k 150 --epochs 8 --quiet ;;
    both*) SWITCH=0.001 SHARING=file_system e2e $k 150 --epochs 8 --quiet ;;
    yuv*) YUV=1 e2e $k 150 --epochs 8 --quiet ;;
    depth6*) DEPTH=6 e2e $k 150 --epochs 8 --quiet ;;
    ro_yuv*) YUV=1 e2e $k 170 --epochs 8 --quiet --compile-mode reduce-overhead ;;
    ro_rgb*) e2e $k 170 --epochs 8 --quiet --compile-mode reduce-overhead ;;
    new_profile) e2e $k 150 --epochs 8 --quiet --profile ;;
    long_profile) PROFILE_STEPS=12 e2e $k 170 --epochs 8 --quiet --profile ;;
    nofreeze*) NO_FREEZE=1 GCLOG=$R/gc_$k.json e2e $k 120 --epochs 8 --quiet ;;
    freeze*) GCLOG=$R/gc_$k.json e2e $k 120 --epochs 8 --quiet ;;
    nodecode*) NODECODE=1 e2e $k 120 --epochs 8 --quiet ;;
    noresample*) NORESAMPLE=1 e2e $k 120 --epochs 8 --quiet ;;
    nogpu*) NODECODE=1 NORESAMPLE=1 e2e $k 120 --epochs 8 --quiet ;;
    own*) OWNSTREAM=1 e2e $k 120 --epochs 8 --quiet ;;
    noreserve*) NORESERVE=1 e2e $k 120 --epochs 8 --quiet ;;
    threads2*) THREADS=2 e2e $k 120 --epochs 8 --quiet ;;
    *) e2e $k 120 --epochs 8 --quiet ;;
  esac
  report $k
  if [[ $k == *profile ]]; then
    python3 benchmarks/trace_gaps.py /tmp/imagenet/run-$k/profile/trace.json --out $R/gaps_$k.json | head -40
  fi
  echo "  $(( $(date +%s)-S ))s"
done
