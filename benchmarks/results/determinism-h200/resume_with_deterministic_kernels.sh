source "$(dirname "$0")/../imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh"  # environment, $R
mkdir -p /tmp/det && cat > /tmp/det/sitecustomize.py <<'PY'
import os, torch
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True)
type(torch.backends.cudnn).benchmark = property(lambda self: False, lambda self, value: None)
PY
export CUBLAS_WORKSPACE_CONFIG=:4096:8
PYTHONPATH=/tmp/det:$PYTHONPATH timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_train.py -k sigkill > $R/resume_deterministic.log 2>&1; echo "deterministic resume test rc $?"; grep -E "passed|failed|^E " $R/resume_deterministic.log | head -5
