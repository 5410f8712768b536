#!/usr/bin/env bash
# The acceleration ladder (`gpuaccel bench`) for ResNet-18 on the JPEG CIFAR-10 folder,
# plus a short training run with the worker loader to show the monitors in the log.
# Usage (on a GPU machine, data under DATA): bash benchmarks/bench_ladder/bench_ladder.sh DATA OUT [bench options]
set -euo pipefail
DATA=${1:?data dir holding cifar10/}; OUT=${2:?output dir}; shift 2
export PYTHONPATH=src PYTHONUNBUFFERED=1 GPUACCEL_CACHE_DIR=/tmp/gpuaccel-cache
python3 -m gpuaccel bench --data "$DATA/cifar10" --model resnet18 --run-dir /tmp/runs/ladder "$@" 2>&1 | tee "$OUT/ladder.log"
cp /tmp/runs/ladder/results.json /tmp/runs/ladder/report.html /tmp/runs/ladder/gpu.jsonl "$OUT/"
python3 -m gpuaccel train --data "$DATA/cifar10" --model resnet18 --epochs 2 --batch-size 512 --lr 0.2 \
    --crop-padding 4 --flip random --loader cpu --run-dir /tmp/runs/train-cpu-loader 2>&1 | tee "$OUT/train_cpu_loader.log"
cp /tmp/runs/train-cpu-loader/metrics.jsonl "$OUT/train_cpu_loader_metrics.jsonl"
