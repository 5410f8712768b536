#!/usr/bin/env bash
# Call 5: the final code (per-image taps; the reserve of call 3 taken out again) on another machine,
# alternated with the own-stream probe (training on a stream of its own, nvJPEG on the default stream).
KERNEL= TESTS= MEMORY_MODES=default RUNS="new_r1 own_r1 new_r2 own_r2 new_r3 own_r3 new_r4" \
bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
