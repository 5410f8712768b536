#!/usr/bin/env bash
# The final deployment measurements with onnxruntime-gpu: the deploy tests on the GPU, then
# bench-infer with the GPU-bound ONNX Runtime rows, quantize --fp16, onnx_gpu_options.py.
set -uo pipefail
R=/tmp/res3
source .carry/ort_setup.sh  # as ran: these lines inline; moved here after the runs
{ date -u; git rev-parse HEAD; git status --short; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $R/machine.txt
mkdir -p /tmp/data && tar -xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_deploy.py -rs 2>&1 | grep -E "passed|failed|FAILED|Error|assert" > $R/pytest_deploy.txt
cat $R/pytest_deploy.txt
RUN=/tmp/deploy-run
python3 -m gpuaccel train --data /tmp/data/cifar10 --model resnet18 --epochs 18 --batch-size 512 --lr 0.2 --crop-padding 4 \
    --flip random --label-smoothing 0.1 --run-dir $RUN --json > $R/train.json
for i in 1 2; do
  timeout 240 python3 -m gpuaccel bench-infer $RUN --json > $R/bench_infer_$i.json 2> $R/bench_infer_$i.err
  python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))['rows']]" $R/bench_infer_$i.json
done
python3 -m gpuaccel bench-infer $RUN > $R/bench_infer_table.txt 2>/dev/null; cat $R/bench_infer_table.txt
python3 -m gpuaccel quantize $RUN --fp16 --json > $R/quantize_fp16.json 2>/dev/null
python3 -c "import json,sys; q=json.load(open(sys.argv[1])); print(q['device'], q['fp32'], q['fp16'])" $R/quantize_fp16.json
python3 -m gpuaccel export $RUN --format onnx --dynamic-batch --json > $R/export.json 2>/dev/null
timeout 150 python3 benchmarks/onnx_gpu_options.py $RUN/model.onnx $RUN/model.fp16.onnx --out $R/onnx_gpu_options.json 2>&1 | grep '^{' | cut -c1-220
