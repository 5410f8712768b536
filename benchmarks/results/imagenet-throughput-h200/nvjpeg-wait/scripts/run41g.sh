source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt; git log -1 --format=%H >> $R/gpu.txt
python3 -c "import torch; from gpuaccel.data import nvjpeg; print('default decoder:', nvjpeg.BatchDecoder.open(torch.device('cuda')).kind)" 2>&1 | tail -1 | tee $R/default_decoder.txt
S=$(date +%s)
timeout 520 python3 -m pytest -q -p no:cacheprovider tests/ > $R/tests_gpu.log 2>&1; echo "tests rc $? $(( $(date +%s)-S ))s"; tail -4 $R/tests_gpu.log; grep -E "^(FAILED|ERROR)" $R/tests_gpu.log | head
