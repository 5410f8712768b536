# session 31, call 2: the freeze fix on Python 3.12 (test + whole commands), and where the warm command's time goes (clocks around the warm-up's parts; cProfile of the whole command in-process)
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; git log --oneline -1 2>/dev/null; } 2>&1 | tee $OUT/s31_call2_info.txt
for i in 1 2 3 4 5; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /tmp/run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i | tee -a $OUT/s31_call2_info.txt; done
python3 -c "
import json; runs=[json.load(open(f'/tmp/run{i}.json')) for i in range(1,6)]
json.dump(runs, open('$OUT/s31_call2_whole_command_runs.json','w'), indent=1)
for s in runs: print(s['test_accuracy'], s['train_seconds'], {k[:12]: v for k, v in s['phases'].items()})"
for r in 1 2; do /usr/bin/time -f "timed wall %e s" python3 .carry/scripts/prof_cli.py timed $OUT/s31_call2_timed$r.json > /dev/null 2>/tmp/terr; tail -2 /tmp/terr | cut -c1-1500; done
/usr/bin/time -f "profiled wall %e s" python3 .carry/scripts/prof_cli.py profile $OUT/s31_call2_warm.pstats > /dev/null 2>/tmp/perr; tail -1 /tmp/perr
python3 -c "import time; t=time.perf_counter(); import sys; sys.path.insert(0,'src'); from gpuaccel.data.formats import _scan_tree; from pathlib import Path; a=time.perf_counter(); r=_scan_tree(Path('/tmp/data/cifar10')); print('scan tree', len(r[0]), round(time.perf_counter()-a,3), 's')" | tee -a $OUT/s31_call2_info.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k frozen --tb=short -rfE 2>&1 | tail -4 | tee -a $OUT/s31_call2_info.txt
