# session 32 call 5: batch-norm statistics of ResNet-50's expansions from their inputs' Gram matrices: alone and in the whole step (batch 512)
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
python3 benchmarks/resnet50_kernels.py --parts variants kernels kernels-fused-bn-gram --batch 512 --variants default fused-bn-gram \
  --timeout 200 --work $OUT/work --out $OUT/call5_variants.json
python3 benchmarks/conv1x1_stats.py --batch 512 --out $OUT/call5_gram_stats.json 2>&1 | tail -12
