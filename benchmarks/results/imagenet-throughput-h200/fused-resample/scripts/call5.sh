#!/usr/bin/env bash
# Call 5, CUDA graphs (reduce-overhead) with RGB and YUV output; in-memory reduce-overhead (run after the runs in the call itself).
KERNEL= TESTS= MEMORY_MODES=reduce-overhead RUNS="ro_rgb_r1 ro_yuv_r1 ro_yuv_r2 ro_rgb_r2" bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
