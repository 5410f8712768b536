set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/benchmarks GPUACCEL_CACHE_DIR=/tmp/gpc TORCHINDUCTOR_CACHE_DIR=/tmp/ind PYTHONUNBUFFERED=1
mkdir -p $OUT/w
python3 -c "import torch, cudnn; print('frontend', cudnn.__version__, 'backend', cudnn.backend_version(), 'torch cudnn', torch.backends.cudnn.version())" 2>&1 | tail -5
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py -x -k "gpu or cudnn or fused" 2>&1 | tail -40 > $OUT/w/tests.log; tail -5 $OUT/w/tests.log
python3 benchmarks/resnet50_kernels.py --parts variants --variants default fused-bn-statistics fused-bn-blocks --timeout 220 --work $OUT/w --out $OUT/w/kernels.json
