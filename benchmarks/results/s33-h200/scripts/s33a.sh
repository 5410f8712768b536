# session 33 call 1: the folded Gram batch norm (new) against session 32's Gram statistics (old) and off, batch 512
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
NEW=$PWD/src:$PWD/benchmarks; OLD=$PWD/.carry/s33start/src:$PWD/benchmarks
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
PYTHONPATH=$NEW python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py -k "gram" 2>&1 | tail -3
for round in 1 2; do
  PYTHONPATH=$NEW python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants fused-bn-gram \
    --timeout 150 --work $OUT/new$round --out $OUT/call1_new_round$round.json
  PYTHONPATH=$OLD python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants fused-bn-gram \
    --timeout 150 --work $OUT/old$round --out $OUT/call1_old_round$round.json
done
PYTHONPATH=$NEW python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants default \
    --timeout 150 --work $OUT/off --out $OUT/call1_off.json
