# session 29, call 2: ResNet-50 step variants never measured (inductor reduction schedules, 1x1 convolutions as matrix products, batch size)
export PYTHONPATH=$PWD/src:$PWD/benchmarks TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 580 python3 benchmarks/resnet50_kernels.py --parts variants --timeout 150 --work /tmp/r50 --out $OUT/call2_resnet50_variants.json \
  --variants default mix-order-reduction cooperative-reductions combo-kernels conv-1x1-as-mm batch-384 batch-512 2>&1 | cut -c1-400
cp /tmp/r50/*.log $OUT/ 2>/dev/null; true
