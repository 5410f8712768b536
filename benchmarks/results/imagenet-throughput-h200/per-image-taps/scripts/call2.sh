#!/usr/bin/env bash
# Call 2: where the pipeline thread's time goes under load (every run logs it, PRODLOG), and two
# probes of the decoder's cost: training on a stream of its own with nvJPEG given the default
# stream (own_*), and nvJPEG writing YUV planes without its conversion kernels (yuv_*, colours wrong).
KERNEL= TESTS= MEMORY_MODES=default RUNS="new_r1 own_r1 yuv_r1 new_r2 own_r2 yuv_r2 own_r3" \
bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
