export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=src
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
TIMEFORMAT="%R"
run() { tag=$1; shift; w=$( { time "$@" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/$tag --json > /tmp/$tag.json 2> /tmp/$tag.err; } 2>&1 ); python3 -c "
import json; s=json.load(open('/tmp/$tag.json')); p=s['phases']; w=float('$w')
row={'run': '$tag', 'env': '$*', 'command_seconds': w, 'exit_seconds': round(w-sum(p.values()),3), 'accuracy': s['test_accuracy'], 'phases': p}
print(json.dumps(row)); open('$OUT/whole_command.jsonl','a').write(json.dumps(row)+'\n')" | cut -c1-600 || tail -3 /tmp/$tag.err; }
run first env
run warm1 env
run warm2 env
run warm3 env
run t1a env TORCHINDUCTOR_COMPILE_THREADS=1
run t1b env TORCHINDUCTOR_COMPILE_THREADS=1
run nowarm env TORCH_WARM_POOL=0
run coldA env TORCHINDUCTOR_CACHE_DIR=/tmp/indA TRITON_CACHE_DIR=/tmp/triA
run coldB env TORCHINDUCTOR_CACHE_DIR=/tmp/indB TRITON_CACHE_DIR=/tmp/triB TORCHINDUCTOR_COMPILE_THREADS=1
run warm4 env
for t in 0 1; do
  S=$(date +%s.%N); env $( [ $t = 1 ] && echo TORCHINDUCTOR_COMPILE_THREADS=1 ) EXITPROBE_LOG=$OUT/exitprobe.log python3 .carry/scripts/exitprobe.py $S -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/probe$t --json > /tmp/probe$t.json 2>/tmp/probe$t.err
  E=$(date +%s.%N); python3 -c "print('wall', $E - $S, 'threads1=$t')" >> $OUT/exitprobe.log
done
python3 -m cProfile -o /tmp/prof.out -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --run-dir /tmp/prof --json > /tmp/prof.json 2>/tmp/prof.err
python3 -c "
import pstats, json
print(json.load(open('/tmp/prof.json'))['phases'])
pstats.Stats('/tmp/prof.out').sort_stats('cumulative').print_stats(90)" > $OUT/profile.txt 2>&1
tail -c 3000 $OUT/exitprobe.log
