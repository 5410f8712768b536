source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
python3 -c "import torch, torchvision; print(torch.__version__, torchvision.__version__)" >> $R/gpu.txt; cat $R/gpu.txt
git log -1 --format=%H > $R/commit.txt 2>/dev/null
S=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py > $R/tests_with_wait.log 2>&1; echo "tests rc $? $(( $(date +%s)-S ))s"; tail -3 $R/tests_with_wait.log
for i in 1 2; do
timeout 60 python3 -c "import sys, pytest, gpuaccel.data.nvjpeg as n; n.drain_before_decoding = lambda device: None; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_stream.py', '-k', 'queued']))" > $R/tests_without_wait_$i.log 2>&1; echo "without wait rc $?"; grep -E "passed|failed|assert " $R/tests_without_wait_$i.log | tail -4
done
S=$(date +%s)
timeout 120 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/gen.json 2>&1 | grep -v Warn | tail -1; echo "gen $(( $(date +%s)-S ))s"
S=$(date +%s)
timeout 170 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases memory --modes default --out $R/memory.json 2>&1 | grep -v Warn | tail -3 | cut -c1-300; echo "memory $(( $(date +%s)-S ))s"
