# session 30, call 7 (a fresh machine): the whole command, a first run and six warm runs; then each test file in a process of its own, with a GPU, to find the failures call 5 saw
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime
for i in 1 2 3 4 5 6 7; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /tmp/run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i; done
python3 -c "
import json; runs=[json.load(open(f'/tmp/run{i}.json')) for i in range(1,8)]
json.dump(runs, open('$OUT/call7_whole_command_runs.json','w'), indent=1)
for s in runs: print(s['test_accuracy'], s['train_seconds'], {k[:12]: v for k, v in s['phases'].items()})"
end=$((SECONDS+420))
for f in tests/test_*.py; do left=$((end-SECONDS)); [ $left -lt 5 ] && { echo "no time for $f"; continue; }; echo "== $f"; timeout $left python3 -m pytest -q -p no:cacheprovider $f --tb=short -rfE 2>&1 | grep -E "^(FAILED|ERROR)|^E  |passed|failed|Timeout" | head -30; done > $OUT/call7_tests_by_file.log 2>&1
grep -E "^==|FAILED|ERROR|passed|failed|no time" $OUT/call7_tests_by_file.log | grep -B1 -E "FAILED|ERROR|failed|no time"
