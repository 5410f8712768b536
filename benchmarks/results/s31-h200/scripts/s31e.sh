# session 31, call 5: before/after on one machine: the whole cifar10-fast command with the code of the session's start (870f3f8) and now (garbage-collector freeze active on Python 3.12, eager evaluation, no cuDNN search), 5 seeds alternating; then now with the two start-up settings turned back on; GPU tests of this session
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; } 2>&1 | tee $OUT/s31_call5_info.txt
timeout 330 python3 benchmarks/redesign_speed.py --old $PWD/.carry/s31start/src --new $PWD/src --parts cifar10 --cifar10 /tmp/data/cifar10 --seeds 5 --work /tmp/redesign --out $OUT/s31_call5_before_after.json 2>&1 | grep cifar10 | cut -c1-330
for i in 1 2 3; do /usr/bin/time -f "wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --cudnn-benchmark --compile-eval --seed $i --json > /tmp/on$i.json 2>/tmp/onerr$i; tail -1 /tmp/onerr$i | tee -a $OUT/s31_call5_info.txt; done
python3 -c "
import json; runs=[json.load(open(f'/tmp/on{i}.json')) for i in (1,2,3)]
json.dump(runs, open('$OUT/s31_call5_search_and_compiled_eval_on.json','w'), indent=1)
for s in runs: print(s['test_accuracy'], s['train_seconds'], s['warmup_seconds'], s['wall_seconds'])"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k "cudnn or frozen or compile_eval" 2>&1 | tail -2 | tee -a $OUT/s31_call5_info.txt
