# session 32 call 2: the Triton 1x1 convolution with batch-norm statistics: alone, and in the whole step (batch 512)
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
python3 benchmarks/conv1x1_stats.py --batch 512 --out $OUT/call2_conv1x1_stats.json 2>&1 | tail -40
python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants default fused-bn-1x1 \
  --timeout 200 --work $OUT/work --out $OUT/call2_variants.json
