# session 32 call 1: ResNet-50 in memory, batch 512: the 1x1 convolutions as matrix products, with and without inductor's GEMM templates
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants default linear-1x1 linear-1x1-autotune-gemm \
  --timeout 420 --work $OUT/work --out $OUT/call1_variants.json
