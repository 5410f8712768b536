#!/usr/bin/env bash
# A repeat of ov_run.sh's CPU measurements on another lease: ResNet-18 trained again, quantised,
# evaluated and timed in OpenVINO and ONNX Runtime.
set -uo pipefail
source "$(dirname "$0")/ov_setup.sh"
{ date -u; cat .carry/commit.txt; lscpu | grep -E "Model name|^CPU\(s\)"; } > $R/machine.txt; cat $R/machine.txt
train_resnet18
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --runtime openvino > $R/quantize_int8_openvino.txt 2>&1
grep -v -i warn $R/quantize_int8_openvino.txt
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --json > $R/quantize_int8_onnxruntime.json 2>/dev/null
timeout 240 python3 benchmarks/int8_latency.py $RUN --openvino --out $R/int8_latency_openvino.json 2>&1 | grep '^{' | cut -c1-400
python3 -c "import json; print(json.load(open('$R/train.json'))['test_accuracy'])"
