source "$(dirname "$0")/common.sh"
[ -d /tmp/imagenet/folder ] || { echo "no data"; exit 3; }
summ() { python3 -c "import json; s=json.load(open('$R/summary_$1.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'], s['epochs'])" 2>/dev/null; }
S=$(date +%s); GPUACCEL_NVJPEG=direct e2e direct_long 200 --epochs 30 --quiet; summ direct_long; echo "  $(( $(date +%s)-S ))s"
S=$(date +%s)
timeout 130 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json 2>&1 | grep -v Warn | tail -2 | cut -c1-300; echo "memory $(( $(date +%s)-S ))s"
