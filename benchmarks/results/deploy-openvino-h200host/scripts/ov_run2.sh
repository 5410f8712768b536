#!/usr/bin/env bash
# OpenVINO's settings on the host CPU (benchmarks/openvino_options.py), on ResNet-18 trained as in ov_run.sh.
set -uo pipefail
source "$(dirname "$0")/ov_setup.sh"
{ date -u; cat .carry/commit.txt; lscpu | grep -E "Model name|^CPU\(s\)"; } > $R/machine.txt; cat $R/machine.txt
train_resnet18
python3 -m gpuaccel export $RUN --format onnx --dynamic-batch --json > $R/export.json 2>/dev/null
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --json > $R/quantize_int8.json 2>/dev/null
timeout 400 python3 benchmarks/openvino_options.py $RUN/model.onnx $RUN/model.int8.onnx --out $R/openvino_options.json 2>&1 | grep -v -i warn | cut -c1-900
