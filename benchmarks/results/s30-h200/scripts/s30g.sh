# session 30, call 8 (a fresh machine): the whole test suite in one process, with a GPU, after the fixes (a failed CUDA-graph capture no longer leaves the generator capturing; infer's device in test_language)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 GPUACCEL_CACHE_DIR=/tmp/gpc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python3 -m pytest -q -p no:cacheprovider tests --tb=short -rfE --durations=8 > $OUT/call8_tests_gpu.log 2>&1; echo rc $?
grep -E "^(FAILED|ERROR)|^E  |passed|failed" $OUT/call8_tests_gpu.log | head -40
