#!/usr/bin/env bash
# Call 1: the resampler looping over each image's own taps (head: 28d7588, the batch's widest filter
# for every image), kernel alone over tile shapes; GPU tests; in memory; end to end alternated with
# head, and the ablations that cut the pipeline's GPU work out.
KERNEL_ARGS="--blocks 64,128 --warps 4 --taps 2,4,8" MEMORY_MODES=default \
RUNS="head_r1 new_r1 nogpu_r1 nodecode_r1 noresample_r1 new_r2 head_r2" \
bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
