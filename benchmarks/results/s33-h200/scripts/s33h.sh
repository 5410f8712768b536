# session 33 call 8: ResNet-50 (CIFAR stem) trained on CIFAR-10 with the folded batch norms (GPUACCEL_FUSED_BN=gram, the default) and without (off), 2 seeds, alternated
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPUACCEL_CACHE_DIR=/tmp/gpc
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
START=$(date +%s)
for run in off_1 gram_1 off_2 gram_2 off_3 gram_3; do
  if (( $(date +%s) - START > 420 )); then echo "$run skipped"; continue; fi
  GPUACCEL_FUSED_BN=${run%_*} timeout 170 python3 -m gpuaccel train --data /tmp/data/cifar10 --model resnet50 --epochs 12 \
    --batch-size 512 --lr 0.2 --crop-padding 4 --flip random --label-smoothing 0.1 --precision bf16 --compile \
    --seed ${run#*_} --run-dir /tmp/runs/$run --json > $OUT/call8_$run.json 2> $OUT/call8_$run.err
  python3 -c "
import json; s=json.load(open('$OUT/call8_$run.json')); print('$run', s['test_accuracy'], s['test_loss'], s['images_per_second'], s['train_seconds'], s['warmup_seconds'])" || tail -3 $OUT/call8_$run.err
done
