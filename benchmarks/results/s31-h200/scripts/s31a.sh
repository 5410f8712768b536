# session 31, call 1 (a fresh H200): (1) objects frozen out of the garbage collector at start-up? (2) the whole command with the faster "reading the data" (first run, 6 warm runs); (3) a warm run under cProfile and one under -X importtime; (4) test_train.py alone
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; nproc; python3 -c "import torch; print(torch.__version__)"
python3 -c "import gc, sys; print('frozen at start-up:', gc.get_freeze_count(), sorted(m for m in sys.modules if 'custom' in m or 'site' in m))"
python3 -S -c "import gc; print('frozen without site:', gc.get_freeze_count())"
python3 -c "import gc, torch; print('frozen after import torch:', gc.get_freeze_count())"
python3 -c "import gc, pytest; print('frozen after import pytest:', gc.get_freeze_count())"
} 2>&1 | tee $OUT/s31_call1_info.txt
for i in 1 2 3 4 5 6 7; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /tmp/run$i.json 2> /tmp/err$i; tail -1 /tmp/err$i | tee -a $OUT/s31_call1_info.txt; done
python3 -c "
import json; runs=[json.load(open(f'/tmp/run{i}.json')) for i in range(1,8)]
json.dump(runs, open('$OUT/s31_call1_whole_command_runs.json','w'), indent=1)
for s in runs: print(s['test_accuracy'], s['train_seconds'], {k[:12]: v for k, v in s['phases'].items()})"
/usr/bin/time -f "profiled wall %e s" python3 -m cProfile -o $OUT/s31_call1_warm.pstats -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /tmp/prof.json 2>/tmp/proferr; tail -1 /tmp/proferr
python3 -c "
import pstats; p = pstats.Stats('$OUT/s31_call1_warm.pstats'); p.sort_stats('cumulative').print_stats(220); p.sort_stats('tottime').print_stats(60)" > $OUT/s31_call1_warm_profile.txt 2>&1
python3 -X importtime -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /tmp/imp.json 2>/tmp/imp.txt
sort -t'|' -k2 -n -r /tmp/imp.txt | head -120 > $OUT/s31_call1_importtime.txt
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_train.py --tb=short -rfE 2>&1 | tail -15 > $OUT/s31_call1_test_train.log; cat $OUT/s31_call1_test_train.log
