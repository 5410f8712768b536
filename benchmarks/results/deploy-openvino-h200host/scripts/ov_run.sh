#!/usr/bin/env bash
# OpenVINO on the GPU machine's host CPU: the cp312 wheel's CPU plugin, ONNX and IR front ends
# (the GPU/NPU plugins and other front ends removed to fit the 64 MiB carry), then ResNet-18
# trained on the CIFAR-10 JPEG folder, quantised, and timed in both runtimes.
set -uo pipefail
source "$(dirname "$0")/ov_setup.sh"
{
  python3 -c "import torch, onnxruntime as ort, openvino as ov; print('torch', torch.__version__, 'onnxruntime', ort.__version__, 'openvino', ov.__version__, ov.Core().get_property('CPU', 'OPTIMIZATION_CAPABILITIES'))"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket"
  echo "isa: $(lscpu | grep -o -E 'amx[a-z_0-9]*|avx512_vnni|avx_vnni|avx512_bf16' | sort -u | tr '\n' ' ')"
  date -u; cat .carry/commit.txt
} > $R/machine.txt 2>&1
cat $R/machine.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_deploy.py -k "openvino or runtime or bench_infer_covers" -rs 2>&1 | tail -3 > $R/pytest_openvino.txt
cat $R/pytest_openvino.txt
train_resnet18
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --json > $R/quantize_int8_onnxruntime.json 2>/dev/null
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --runtime openvino --json \
    > $R/quantize_int8_openvino.json 2>/dev/null
python3 - $R <<'PY'
import json, sys
out = sys.argv[1]
print("train", json.load(open(f"{out}/train.json"))["test_accuracy"])
for k in ("onnxruntime", "openvino"):
    q = json.load(open(f"{out}/quantize_int8_{k}.json")); print("quantize", k, json.dumps({m: q[m] for m in ("fp32", "int8")}))
PY
timeout 240 python3 benchmarks/int8_latency.py $RUN --openvino --out $R/int8_latency_openvino.json 2>&1 | grep '^{' | cut -c1-400
timeout 240 python3 -m gpuaccel bench-infer $RUN > $R/bench_infer_table.txt 2> $R/bench_infer.err; cat $R/bench_infer_table.txt
timeout 200 python3 -m gpuaccel bench-infer $RUN --json > $R/bench_infer.json 2>/dev/null
