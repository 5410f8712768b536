# session 33 call 6: the whole test suite on the GPU, in two processes side by side (the files split in two)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
A="tests/test_train.py tests/test_stream.py tests/test_recsys.py tests/test_run_files.py tests/test_prune.py tests/test_recipes_and_engine.py tests/test_parallel.py"
B=$(ls tests/test_*.py | grep -v -F "$(echo $A | tr ' ' '\n')")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu_call6.txt
timeout 560 python3 -m pytest -q -p no:cacheprovider $A --tb=short -rfE --durations=5 > $OUT/call6_tests_a.log 2>&1 &
timeout 560 python3 -m pytest -q -p no:cacheprovider $B --tb=short -rfE --durations=5 > $OUT/call6_tests_b.log 2>&1 &
wait
for f in $OUT/call6_tests_a.log $OUT/call6_tests_b.log; do echo "== $f"; grep -v "^DEBUG" $f | tail -14; done
