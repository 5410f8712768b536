#!/usr/bin/env bash
# Pruning measurements for ResNet-18 on 32 px CIFAR-10 (the JPEG folder): train it on the GPU,
# then 50% channel pruning + a short fine-tune, and 50% magnitude pruning for comparison.
# CPU latency and throughput are measured by `gpuaccel prune` on this host's CPU.
# Usage (on a GPU machine): bash benchmarks/deploy/prune_resnet18.sh DATA_DIR/cifar10 OUT
set -euo pipefail
DATA=${1:?CIFAR-10 folder}; OUT=${2:?output dir}
export PYTHONPATH=src PYTHONUNBUFFERED=1
RUN=/tmp/prune-run
python3 -m gpuaccel train --data "$DATA" --model resnet18 --epochs 18 --batch-size 512 --lr 0.2 --crop-padding 4 \
    --flip random --label-smoothing 0.1 --run-dir $RUN --json > "$OUT/train.json"
python3 -m gpuaccel prune $RUN --structured --sparsity 0.5 --finetune-epochs 5 --out $RUN/structured --json \
    > "$OUT/prune_structured.json"
python3 -m gpuaccel prune $RUN --sparsity 0.5 --finetune-epochs 2 --out $RUN/unstructured --json \
    > "$OUT/prune_unstructured.json"
lscpu | grep -E "Model name|^CPU\(s\)" > "$OUT/cpu.txt"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("train", json.load(open(f"{out}/train.json"))["test_accuracy"])
for name in ("structured", "unstructured"):
    r = json.load(open(f"{out}/prune_{name}.json"))
    print(name, {k: r[k] for k in ("pruned_accuracy", "speedup_batch1", "speedup_throughput", "accuracy_drop_points")})
    for side in ("before", "after"):
        print("  ", side, r[side])
PY
