source "$(dirname "$0")/common.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $R/gpu.txt
summ() { python3 -c "import json; s=json.load(open('$R/summary_$1.json')); print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'])" 2>/dev/null; }
S=$(date +%s)
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_stream.py -k "direct_decoders or queued" > $R/tests_with_wait.log 2>&1; echo "tests rc $? $(( $(date +%s)-S ))s"; tail -2 $R/tests_with_wait.log
timeout 40 python3 -c "import sys, pytest, gpuaccel.data.nvjpeg as n; n.drain_before_decoding = lambda device: None; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_stream.py', '-k', 'queued']))" > $R/tests_without_wait.log 2>&1; echo "without wait rc $?"; grep -E "passed|failed|assert |^FAILED" $R/tests_without_wait.log | tail -6
S=$(date +%s)
timeout 60 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --images 12000 --phases generate --out $R/gen.json 2>&1 | tail -1; echo "gen $(( $(date +%s)-S ))s"
S=$(date +%s)
GPUACCEL_NVJPEG=hybrid timeout 80 python3 benchmarks/imagenet_throughput.py --work /tmp/imagenet --phases pipeline --skip-baselines --out $R/pipeline_hybrid.json 2>&1 | grep gpuaccel | cut -c1-250; echo "pipeline $(( $(date +%s)-S ))s"
S=$(date +%s); GPUACCEL_NVJPEG=hybrid e2e hybrid_r1 130 --epochs 8 --quiet; summ hybrid_r1; echo "  $(( $(date +%s)-S ))s"
GPUACCEL_NVJPEG=direct e2e direct_r1 70 --epochs 8 --quiet; summ direct_r1
GPUACCEL_NVJPEG=torchvision e2e tv_r1 70 --epochs 8 --quiet; summ tv_r1
GPUACCEL_NVJPEG=hybrid e2e hybrid_r2 70 --epochs 8 --quiet; summ hybrid_r2
