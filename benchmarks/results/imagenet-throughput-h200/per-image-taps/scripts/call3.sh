#!/usr/bin/env bash
# Call 3: the direct nvJPEG call reserving the JPEG engines' buffers (a decoding state per batch
# size, nvjpegDecodeBatchedPreAllocate), against the same tree without the reserve (noreserve_*);
# GPU tests first.
KERNEL= TESTS=1 MEMORY_MODES=default RUNS="new_r1 noreserve_r1 new_r2 noreserve_r2 new_r3 noreserve_r3 new_r4" \
bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
