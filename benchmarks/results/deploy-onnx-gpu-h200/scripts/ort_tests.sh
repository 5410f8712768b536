#!/usr/bin/env bash
# The whole test suite on the GPU with onnxruntime-gpu installed (set up by ort_setup.sh).
set -uo pipefail
R=/tmp/res4
source .carry/ort_setup.sh
{ date -u; git rev-parse HEAD; git status --short; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > $R/machine.txt
timeout 560 python3 -m pytest -q -p no:cacheprovider -x -rs tests/ > $R/tests_all_gpu_ort.log 2>&1
grep -E "passed|failed|SKIPPED|FAILED|Error" $R/tests_all_gpu_ort.log | tail -20
