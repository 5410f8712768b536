#!/usr/bin/env bash
# Call 7: the trainer freezing the objects left by compilation (gc.freeze after the warm-up),
# against the same code without it; in memory first.
KERNEL= TESTS= RUNS="nofreeze_r1 freeze_r1 nofreeze_r2 freeze_r2 nofreeze_r3 freeze_r3" bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
