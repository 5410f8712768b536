# session 32 call 3: the 1x1 convolution with statistics on Hopper's TMA; the whole step and its kernels, batch 512
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
python3 -c "import triton; print('triton', triton.__version__)"
python3 benchmarks/conv1x1_stats.py --batch 512 --out $OUT/call3_conv1x1_stats.json 2>&1 | tail -3
python3 benchmarks/resnet50_kernels.py --parts variants kernels kernels-fused-bn-1x1 --batch 512 --variants default fused-bn-1x1 \
  --timeout 200 --work $OUT/work --out $OUT/call3_variants.json
