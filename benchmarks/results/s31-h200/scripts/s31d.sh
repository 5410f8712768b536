# session 31, call 4: cuDNN's algorithm search done ahead on a copy of the model (PROBE_PRETUNE seq: before the warm-up; thread: beside Dynamo's tracing), against the plain warm command, alternating
export GPUACCEL_CACHE_DIR=/tmp/gpc PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p /tmp/data && tar xzf .carry/cifar10-jpg.tar.gz -C /tmp/data
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader; uptime; } 2>&1 | tee $OUT/s31_call4_info.txt
/usr/bin/time -f "cold wall %e s" python3 -m gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json > /dev/null 2>/tmp/cold; tail -1 /tmp/cold | tee -a $OUT/s31_call4_info.txt
n=0
for round in 1 2 3; do for v in none seq thread; do n=$((n+1))
  PROBE_PRETUNE=$v /usr/bin/time -f "wall %e s" python3 .carry/scripts/prof_cli.py variant /tmp/v$n.json 2>/tmp/verr > /dev/null
  echo "$v $(tail -1 /tmp/verr) $(grep -E 'probe|pretune took|Error' /tmp/verr | cut -c1-300)" | tee -a $OUT/s31_call4_info.txt
  python3 -c "import json,sys; d=json.load(open('/tmp/v$n.json')); w=open('/tmp/verr').read().strip().splitlines()[-1]; d['probe']['wall']=w; json.dump(d, open('/tmp/v$n.json','w'))"
done; done
python3 -c "
import json; json.dump([json.load(open(f'/tmp/v{i}.json')) for i in range(1, $n+1)], open('$OUT/s31_call4_variants.json','w'), indent=1)"
