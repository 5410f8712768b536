# session 34 call 6: the CPU topology; the GPU tests of the streaming loader and the prefetch threads; then
# default mode, batch 512: the code at this call (new) against the session's start (old), alternated, and 0.3 decoded by the readers
lscpu -e=CPU,CORE,SOCKET,NODE > $OUT/lscpu.txt 2>&1; lscpu | head -20 >> $OUT/lscpu.txt
PYTHONPATH=$PWD/src python3 -m pytest -q -p no:cacheprovider tests/test_stream.py tests/test_prefetch.py tests/test_loader.py > $OUT/tests_gpu.log 2>&1; tail -2 $OUT/tests_gpu.log
STEPS="mem1 new_r1 old_r1 new_r2 old_r2 new_cpu30_r1 new_r3" LIMIT=${LIMIT:-500} bash .carry/scripts/s34a.sh
