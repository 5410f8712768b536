source "$(dirname "$0")/../scripts/common.sh"  # environment, $R
unset GPUACCEL_NVJPEG
timeout 60 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/gen.json 2>&1 | tail -1
cat > /tmp/depth.py <<'PY'
import os, sys
import gpuaccel.data.stream as s
depth = int(os.environ["DEPTH"])
inner = s.in_thread
s.in_thread = lambda prepared, side: inner(prepared, side, depth)
from gpuaccel.cli import main
sys.exit(main(sys.argv[1:]))
PY
summ() { python3 -c "import json; s=json.load(open('/tmp/imagenet/run-$1/summary.json')); r=[json.loads(l) for l in open('/tmp/imagenet/run-$1/metrics.jsonl')]; print('$1', s['images_per_second'], [round(x['data_wait'],3) for x in r][-4:], [x['gpu_util'] for x in r][-4:])" | tee -a $R/summary.txt; cp /tmp/imagenet/run-$1/summary.json $R/summary_$1.json; cp /tmp/imagenet/run-$1/metrics.jsonl $R/metrics_$1.jsonl; }
for k in d3_a d8_a d3_b d8_b; do
  d=${k:1:1}; rm -rf /tmp/imagenet/run-$k
  DEPTH=$d timeout 130 python3 /tmp/depth.py train --data /tmp/imagenet/folder --loader stream --model resnet50 --image-size 224 --precision bf16 --compile --compile-mode default --batch-size 256 --eval-batch-size 256 --lr 0.1 --epochs 8 --run-dir /tmp/imagenet/run-$k --quiet > $R/$k.log 2>&1; echo "$k rc $?"; summ $k
done
