#!/usr/bin/env bash
# The first deployment measurements with onnxruntime-gpu (first-runs/).
set -uo pipefail
R=/tmp/res
source .carry/ort_setup.sh  # as ran: these lines inline; moved here after the runs
{
  python3 -c "import torch, torchvision, onnxruntime as ort; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'onnxruntime', ort.__version__, ort.get_available_providers())"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)|Thread\(s\) per core|Core\(s\) per socket"
  echo "isa: $(lscpu | grep -o -E 'amx[a-z_0-9]*|avx512_vnni|avx_vnni' | sort -u | tr '\n' ' ')"
  date -u; git rev-parse HEAD; git status --short
} > $R/machine.txt 2>&1
cat $R/machine.txt
mkdir -p /tmp/data && tar -xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_deploy.py -rs 2>&1 | tail -4 > $R/pytest_deploy.txt
cat $R/pytest_deploy.txt
RUN=/tmp/deploy-run
python3 -m gpuaccel train --data /tmp/data/cifar10 --model resnet18 --epochs 18 --batch-size 512 --lr 0.2 --crop-padding 4 \
    --flip random --label-smoothing 0.1 --run-dir $RUN --json > $R/train.json
python3 -m gpuaccel quantize $RUN --fp16 > $R/quantize_fp16.txt 2>&1; grep -v warning $R/quantize_fp16.txt
python3 -m gpuaccel quantize $RUN --fp16 --json > $R/quantize_fp16.json 2>/dev/null
python3 -m gpuaccel quantize $RUN --int8 --per-channel --calib 512 --json > $R/quantize_int8.json 2>/dev/null
python3 -m gpuaccel export $RUN --format onnx --dynamic-batch --json > $R/export.json 2>/dev/null
python3 -m gpuaccel infer $RUN/model.fp16.onnx /tmp/data/cifar10 --device cuda --out $R/preds_fp16.csv > $R/infer_fp16.txt 2>&1
grep images $R/infer_fp16.txt; head -3 $R/preds_fp16.csv
timeout 240 python3 -m gpuaccel bench-infer $RUN --json > $R/bench_infer.json 2> $R/bench_infer.err
python3 - $R <<'PY'
import json, sys
out = sys.argv[1]
print("train", json.load(open(f"{out}/train.json"))["test_accuracy"])
for k in ("fp16", "int8"):
    q = json.load(open(f"{out}/quantize_{k}.json")); print("quantize", k, q["device"], json.dumps({m: q[m] for m in ("fp32", k)}))
for r in json.load(open(f"{out}/bench_infer.json"))["rows"]: print(r)
PY
timeout 150 python3 benchmarks/onnx_gpu_options.py $RUN/model.onnx $RUN/model.fp16.onnx --out $R/onnx_gpu_options.json 2>&1 | grep -v warning
timeout 200 python3 benchmarks/int8_latency.py $RUN --profile-ops --out $R/int8_latency.json 2>&1 | grep '^{' | cut -c1-200
