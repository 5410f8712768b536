#!/usr/bin/env bash
# Call 1: kernel times over tile shapes, GPU tests, in memory, head/new end to end.
 bash benchmarks/results/imagenet-throughput-h200/fused-resample/scripts/run.sh
