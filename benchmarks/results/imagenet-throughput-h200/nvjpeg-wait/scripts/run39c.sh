source "$(dirname "$0")/common.sh"
[ -d /tmp/imagenet/folder ] || { echo "no data: machine was released"; exit 3; }
mkdir -p /tmp/data && tar xzf "${CIFAR_TGZ:-../shared/data/cifar10-jpg.tar.gz}" -C /tmp/data
for round in 1 2; do
for k in tv_wait tv_nowait direct_wait; do
  S=$(date +%s)
  case $k in tv_wait) GPUACCEL_NVJPEG=torchvision e2e ${k}_r$round 110 --epochs 8 --quiet;; tv_nowait) GPUACCEL_NVJPEG=torchvision NO_WAIT=1 e2e ${k}_r$round 110 --epochs 8 --quiet;;
    direct_wait) GPUACCEL_NVJPEG=direct e2e ${k}_r$round 110 --epochs 8 --quiet;; esac
  python3 -c "import json; s=json.load(open('$R/summary_${k}_r$round.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null
  echo "  $(( $(date +%s)-S ))s"
done; done
for k in tv direct; do
  S=$(date +%s); rm -rf /tmp/cifar-$k
  [ $k = direct ] && export GPUACCEL_NVJPEG=direct || export GPUACCEL_NVJPEG=torchvision
  timeout 90 python3 -m gpuaccel train --data /tmp/data/cifar10 --loader stream --model resnet18 --epochs 4 --run-dir /tmp/cifar-$k --quiet > $R/cifar_$k.log 2>&1; echo "cifar $k rc $? $(( $(date +%s)-S ))s"
  tail -4 $R/cifar_$k.log | cut -c1-200; cp /tmp/cifar-$k/summary.json $R/cifar_summary_$k.json 2>/dev/null
done
