source "$(dirname "$0")/common.sh"
[ -d /tmp/imagenet/folder ] || timeout 120 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/gen.json 2>&1 | tail -1
summ() { python3 -c "import json; s=json.load(open('$R/summary_$1.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null; }
for i in 3 4 5; do GPUACCEL_NVJPEG=direct e2e direct_wait_r$i 110 --epochs 8 --quiet; summ direct_wait_r$i; done
for i in 1 2; do GPUACCEL_NVJPEG=direct e2e direct_shards_r$i 110 --data /tmp/imagenet/shards --epochs 8 --quiet; summ direct_shards_r$i; done
GPUACCEL_NVJPEG=torchvision e2e tv_shards_r1 110 --data /tmp/imagenet/shards --epochs 8 --quiet; summ tv_shards_r1
timeout 100 python3 benchmarks/nvjpeg_variants.py --backends 0 1 2 --flags 0 --formats 3 --out $R/hybrid_variants.json > $R/hybrid.log 2>&1; echo "hybrid rc $?"; tail -8 $R/hybrid.log | cut -c1-400
