#!/usr/bin/env bash
# The direct nvJPEG call beside a CUDA graph, given the default stream or a high-priority stream
# of its own, with the load on the default stream or its own.
set -uo pipefail
source benchmarks/results/imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh
{ date -u; cat .carry/commit.txt; } | tee $R/machine.txt
for ls in own default; do for ds in default side; do
  timeout 100 python3 benchmarks/nvjpeg_variants.py --backends 3 --flags 0 --formats 3 --load-stream $ls --decode-stream $ds \
    --out $R/variants_load_${ls}_decode_${ds}.json > $R/variants_load_${ls}_decode_${ds}.log 2>&1
  python3 -c "import json; d=json.load(open('$R/variants_load_${ls}_decode_${ds}.json')); v=d['b3_f0_o3']; print('load $ls decode $ds', v['host_ms'], v['done_ms'], v['under_load_ms'], 'torchvision', d['torchvision_under_load_ms'])"
done; done
