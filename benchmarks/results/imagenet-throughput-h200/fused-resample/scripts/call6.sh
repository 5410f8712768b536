#!/usr/bin/env bash
# Call 6, the final code on one more machine: kernel time at the module's tile shape, GPU
# tests, in-memory phase, then end to end, head (891b52a) against new, runs alternating.
RUNS="head_r1 new_r1 new_r2 head_r2 new_r3 new_r4" KERNEL_ARGS="--blocks 128 --warps 4 --taps 8" \
  bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/call1.sh
