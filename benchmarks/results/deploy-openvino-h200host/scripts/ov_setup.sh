# Sourced by ov_run.sh, ov_run2.sh and ov_run3.sh (as run, each held these lines itself): the
# reduced OpenVINO wheel (../README.md) and the CIFAR-10 JPEG folder unpacked under /tmp;
# train_resnet18 trains the model every script measures (as deploy_resnet18.sh);
# everything under $R lands in one tarball at exit (the device returns at most 8 files).
REPO=$PWD; R=/tmp/res; mkdir -p $R /tmp/ov /tmp/data
finish() { tar -czf $OUT/results.tar.gz -C $R .; }
trap finish EXIT
tar -xJf .carry/openvino-cp312-cpu.tar.xz -C /tmp/ov && tar -xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
export PYTHONPATH=/tmp/ov:$REPO/src PYTHONUNBUFFERED=1
RUN=/tmp/deploy-run
train_resnet18() {
    python3 -m gpuaccel train --data /tmp/data/cifar10 --model resnet18 --epochs 18 --batch-size 512 --lr 0.2 \
        --crop-padding 4 --flip random --label-smoothing 0.1 --run-dir $RUN --json > $R/train.json 2> $R/train.err
}
