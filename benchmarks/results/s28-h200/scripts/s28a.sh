export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python3 -c "import torch; print(torch.__version__)"
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "step_graph" tests/test_loader.py 2>&1 | tail -3 | tee $OUT/call1_gpu_tests.log
J='"brightness": 0.04, "contrast": 0.15'
timeout 500 python3 benchmarks/tune_recipe.py --recipe cifar10-fast --data /tmp/data/cifar10 --seeds 5 --first-seed 1 \
  --variant '{}' --variant "{$J}" --variant '{"size_schedule": ["24:2"]}' \
  --variant '{"size_schedule": ["24:3"], "epochs": 8.0}' --variant "{\"size_schedule\": [\"24:2\"], $J}" \
  --variant '{"size_schedule": ["20:2", "26:2"], "epochs": 8.0}' --variant "{\"epochs\": 7.2, $J}" \
  --variant '{"size_schedule": ["24:4"], "epochs": 8.4}' \
  --out $OUT/call1_cifar10_fast_variants.json 2>&1 | grep -v Warn | cut -c1-300
