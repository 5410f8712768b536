# Sourced by ort_run2.sh and ort_run3.sh with R set (the results folder): onnxruntime-gpu 1.31.1
# (CUDA 13 build) reassembled on the device. The CUDA provider's library arrives in an earlier
# call on the same warm machine (/tmp/ortparts), stripped to its sm_90 kernels by
# strip_fatbin.py to fit the 64 MiB carry. Everything under $R lands in one tarball at exit
# (the device returns at most 8 files).
REPO=$PWD; mkdir -p $R /tmp/ortgpu
tar -xJf .carry/ort-rest.tar.xz -C /tmp/ortgpu
xz -dc /tmp/ortparts/ort-cuda90.so.xz > /tmp/ortgpu/onnxruntime/capi/libonnxruntime_providers_cuda.so || exit 3
export PYTHONPATH=/tmp/ortgpu:$REPO/src PYTHONUNBUFFERED=1
finish() { tar -czf $OUT/results.tar.gz -C $R .; }
trap finish EXIT
