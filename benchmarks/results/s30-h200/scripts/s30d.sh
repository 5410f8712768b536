# session 30, call 4 (the same machine as calls 1-3): ResNet-50 in memory, variants never measured: batch 768, aggressive fusion (default mode), against the default and batch 512
export PYTHONPATH=$PWD/src:$PWD/benchmarks PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/.gpucache/inductor
timeout 380 python3 benchmarks/resnet50_kernels.py --parts variants --variants default aggressive-fusion batch-512 batch-768 --timeout 150 --work /tmp/r50 --out $OUT/call4_resnet50_variants.json 2>&1 | grep -v Warn | cut -c1-400
