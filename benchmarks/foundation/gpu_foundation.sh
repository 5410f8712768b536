#!/usr/bin/env bash
# The foundation issue's GPU check: LeNet-5 on the canonical MNIST IDX files, plus a
# ResNet-18 run on the JPEG CIFAR-10 folder exercising the GPU-resident data path.
# Usage (on a GPU machine, data under DATA): bash benchmarks/foundation/gpu_foundation.sh DATA OUT
set -euo pipefail
DATA=${1:?data dir holding mnist/ and cifar10/}; OUT=${2:?output dir}
export PYTHONPATH=src PYTHONUNBUFFERED=1 GPUACCEL_CACHE_DIR=/tmp/gpuaccel-cache
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$OUT/env.txt"
run() { name=$1; shift; echo "== $name: gpuaccel train $*"; python3 -m gpuaccel train "$@" --run-dir "/tmp/runs/$name" --json > "$OUT/$name.json"; python3 -c "import json,sys; s=json.load(open('$OUT/$name.json')); print({k: s[k] for k in ('device_name','precision','epochs','wall_seconds','train_seconds','images_per_second','test_accuracy','time_to_target')})"; }
run mnist_lenet5 --data "$DATA/mnist" --model lenet5 --epochs 15 --batch-size 128 --lr 0.05 --label-smoothing 0.1
run mnist_lenet5_target --data "$DATA/mnist" --model lenet5 --epochs 15 --batch-size 128 --lr 0.05 --label-smoothing 0.1 --target-acc 0.99
run cifar10_resnet18 --data "$DATA/cifar10" --model resnet18 --epochs 5 --batch-size 512 --lr 0.2 --crop-padding 4 --flip random --label-smoothing 0.1
run cifar10_resnet18_cpu_loader --data "$DATA/cifar10" --model resnet18 --epochs 2 --batch-size 512 --lr 0.2 --crop-padding 4 --flip random --loader cpu
run digits_demo --recipe digits
