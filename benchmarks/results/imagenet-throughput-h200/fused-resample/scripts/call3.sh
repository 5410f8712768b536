#!/usr/bin/env bash
# Call 3, host-side probes (switch interval, sharing strategy) and a profiled run; no in-memory phase.
KERNEL= TESTS= MEMORY_MODES= RUNS="new_r1 switch1ms_r1 files_r1 new_r2 switch1ms_r2 files_r2 both_r1 new_profile" bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
