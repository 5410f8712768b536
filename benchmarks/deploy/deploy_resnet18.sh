#!/usr/bin/env bash
# Deployment measurements for ResNet-18 on 32 px CIFAR-10 (the JPEG folder): train it,
# export and verify ONNX, quantise to int8 (per-channel), and time every inference backend.
# Usage (on a GPU machine): bash benchmarks/deploy/deploy_resnet18.sh DATA_DIR/cifar10 OUT
set -euo pipefail
DATA=${1:?CIFAR-10 folder}; OUT=${2:?output dir}
export PYTHONPATH=src PYTHONUNBUFFERED=1
RUN=/tmp/deploy-run
python3 -m gpuaccel train --data "$DATA" --model resnet18 --epochs 18 --batch-size 512 --lr 0.2 --crop-padding 4 \
    --flip random --label-smoothing 0.1 --run-dir $RUN --json > "$OUT/train.json"
python3 -m gpuaccel export $RUN --format onnx --json > "$OUT/export.json"
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --json > "$OUT/quantize.json"
python3 -m gpuaccel bench-infer $RUN --json > "$OUT/bench_infer.json"
lscpu | grep -E "Model name|^CPU\(s\)" > "$OUT/cpu.txt"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
t = json.load(open(f"{out}/train.json")); e = json.load(open(f"{out}/export.json"))
q = json.load(open(f"{out}/quantize.json")); b = json.load(open(f"{out}/bench_infer.json"))
print("train", t["test_accuracy"], t["train_seconds"]); print("export", e)
print("quantize", json.dumps({k: q[k] for k in ("fp32", "int8")}))
for r in b["rows"]: print(r)
PY
