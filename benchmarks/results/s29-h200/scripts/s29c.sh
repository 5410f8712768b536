# session 29, call 3: the tuned compile mode at batch 256 and 512
export PYTHONPATH=$PWD/src:$PWD/benchmarks TORCHINDUCTOR_CACHE_DIR=/tmp/inductor PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
timeout 580 python3 benchmarks/resnet50_kernels.py --parts variants --timeout 285 --work /tmp/r50 --out $OUT/call3_resnet50_variants.json \
  --variants tuned batch-512-tuned 2>&1 | cut -c1-400
cp /tmp/r50/*.log $OUT/ 2>/dev/null; true
