#!/usr/bin/env bash
# Call 2: a sweep of warps at 8 column taps, GPU tests, in memory, five end-to-end runs.
KERNEL_ARGS="--blocks 64,128,256 --warps 1,2,4 --taps 8" RUNS="head_r1 new_r1 new_r2 head_r2 new_r3" bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
