# session 33 call 3: the strided shortcuts folded too (new) against the expansions only (fold, commit 6629392), batch 512, default mode; GPU gram tests; kernel profile
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
NEW=$PWD/src:$PWD/benchmarks; FOLD=$PWD/.carry/s33fold/src:$PWD/benchmarks
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/gpu.txt
PYTHONPATH=$NEW python3 -m pytest -q -p no:cacheprovider tests/test_fast_layers.py -k "gram" 2>&1 | tail -3
for round in 1 2; do
  PYTHONPATH=$NEW python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants fused-bn-gram \
    --timeout 120 --work $OUT/new$round --out $OUT/call3_strided_round$round.json
  PYTHONPATH=$FOLD python3 benchmarks/resnet50_kernels.py --parts variants --batch 512 --variants fused-bn-gram \
    --timeout 120 --work $OUT/fold$round --out $OUT/call3_fold_round$round.json
done
PYTHONPATH=$NEW timeout 150 python3 benchmarks/resnet50_kernels.py --parts kernels-fused-bn-gram --batch 512 \
    --timeout 140 --work $OUT/prof --out $OUT/call3_kernels.json
