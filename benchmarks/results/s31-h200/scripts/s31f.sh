# session 31, call 6: target 1 with the new cifar10-fast (no cuDNN search, eager evaluation) against airbench94_muon, side by side, 10 seeds; the recipe with cuDNN's search on beside it; then this session's GPU tests
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 500 python3 benchmarks/airbench_side_by_side.py --airbench .carry/airbench --data /tmp/data/cifar10 \
  --pair cifar10-fast=airbench94_muon.py --runs 8 --seeds 10 \
  --variant '{}' --variant '{"cudnn_benchmark": true}' \
  --out $OUT/s31_call6_airbench94_vs_cifar10_fast.json 2>&1 | grep -v Warn | cut -c1-600
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "cudnn or frozen or compile_eval" -rfE > $OUT/s31_call6_tests.log 2>&1; echo "rc $?" >> $OUT/s31_call6_tests.log; tail -5 $OUT/s31_call6_tests.log
