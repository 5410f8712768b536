source "$(dirname "$0")/common.sh"
[ -d /tmp/imagenet/folder ] || { echo "no data: machine was released"; exit 3; }
S=$(date +%s); GPUACCEL_NVJPEG=torchvision e2e tv_wait 200 --epochs 3; echo "$(( $(date +%s)-S ))s"
S=$(date +%s); GPUACCEL_NVJPEG=torchvision NO_WAIT=1 e2e tv_nowait 170 --epochs 3; echo "$(( $(date +%s)-S ))s"
S=$(date +%s); GPUACCEL_NVJPEG=direct e2e direct_wait1 170 --epochs 3; echo "$(( $(date +%s)-S ))s"
