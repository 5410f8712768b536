# session 32 call 7: the Gram statistics' GPU test; the whole step with and without them again, alternated (batch 512)
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py -k "gram or stem" 2>&1 | tail -3
for round in 1 2; do
  python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants fused-bn-gram default \
    --timeout 200 --work $OUT/work$round --out $OUT/call7_variants_round$round.json
done
