#!/usr/bin/env bash
# Call 4, probes: nvJPEG writing YUV planes, six batches made ahead; no in-memory phase.
KERNEL= TESTS= MEMORY_MODES= RUNS="new_r1 yuv_r1 depth6_r1 new_r2 yuv_r2 depth6_r2" bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
