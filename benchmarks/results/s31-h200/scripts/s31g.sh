# session 31, call 7 (a fresh machine): the final code's whole cifar10-fast command (first run and 6 warm runs), then the whole test suite in one process
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; } 2>&1 | tee $OUT/s31_call7_info.txt
for i in 1 2 3 4 5 6 7; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /tmp/run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i | tee -a $OUT/s31_call7_info.txt; done
python3 -c "
import json; runs=[json.load(open(f'/tmp/run{i}.json')) for i in range(1,8)]
for s, i in zip(runs, range(1, 8)): s['command_wall'] = open(f'/tmp/err{i}').read().strip().splitlines()[-1]
json.dump(runs, open('$OUT/s31_call7_whole_command_runs.json','w'), indent=1)
for s in runs: print(s['command_wall'], s['test_accuracy'], s['train_seconds'], {k[:12]: v for k, v in s['phases'].items()})"
timeout 450 python3 -m pytest -q -p no:cacheprovider tests --tb=short -rfE --durations=8 > $OUT/s31_call7_tests_gpu.log 2>&1; echo "rc $?" >> $OUT/s31_call7_tests_gpu.log; tail -25 $OUT/s31_call7_tests_gpu.log
