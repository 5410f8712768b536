source "$(dirname "$0")/../imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh"  # environment, $R, e2e
unset GPUACCEL_NVJPEG
mkdir -p /tmp/data && tar xzf "${CIFAR_TGZ:-../shared/data/cifar10-jpg.tar.gz}" -C /tmp/data
S=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py tests/test_train.py > $R/tests.log 2>&1; echo "tests rc $? $(( $(date +%s)-S ))s"; tail -1 $R/tests.log; grep -E "^(FAILED|ERROR)" $R/tests.log
for det in "" "--deterministic"; do for comp in "" "--compile"; do
  k=cifar${det:+_det}${comp:+_compile}; rm -rf /tmp/$k
  timeout 120 python3 -m gpuaccel train --data /tmp/data/cifar10 --model resnet18 --epochs 4 --batch-size 512 --lr 0.2 --crop-padding 4 --flip random --label-smoothing 0.1 $det $comp --run-dir /tmp/$k --json --quiet > $R/$k.json 2> $R/$k.err; echo "$k rc $?"; tail -2 $R/$k.err | cut -c1-300
  python3 -c "import json; s=json.load(open('$R/$k.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_accuracy'])" 2>/dev/null
done; done
timeout 60 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/gen.json 2>&1 | tail -1
e2e default_decoder 150 --epochs 8
grep -i "nvjpeg\|decod" $R/default_decoder.log | head -3
python3 -c "import json; s=json.load(open('$R/summary_default_decoder.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])"
