#!/usr/bin/env bash
# Call 4: a profiled run (12 steps from step 20; trace_gaps.py lists the host's CUDA calls that
# blocked, per thread) to see what the nvjpegDecodeBatched call waits for; and per-image taps against
# head (28d7588) once more, on another machine.
KERNEL= TESTS= MEMORY_MODES=default RUNS="new_r1 long_profile head_r1 new_r2 head_r2 new_r3" \
bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
