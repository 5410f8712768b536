#!/usr/bin/env bash
# Call 6, the final code on one more machine: kernel time at the default tile shape, GPU tests, in memory, head/new.
KERNEL_ARGS="--blocks 128 --warps 4 --taps 8" RUNS="head_r1 new_r1 new_r2 head_r2 new_r3 new_r4" bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
