source "$(dirname "$0")/../imagenet-throughput-h200/nvjpeg-wait/scripts/common.sh"  # environment, $R
cat > /tmp/diag.py <<'PY'
import subprocess, sys, torch, json
from gpuaccel.train import checkpoint
def run(d, *extra):
    subprocess.run([sys.executable, "-m", "gpuaccel", "train", "--data", "digits", "--model", "lenet5", "--batch-size", "8",
                    "--epochs", "3", "--checkpoint-every", "10", "--run-dir", d, "--quiet", *extra], check=True, capture_output=True)
    return checkpoint.load(d + "/model.pt")["model"]
out = {}
for name, extra in [("auto", []), ("fp32", ["--precision", "fp32"]), ("fp32_gpu_loader_off", ["--precision", "fp32", "--loader", "cpu"])]:
    a, b = run(f"/tmp/d_{name}_a", *extra), run(f"/tmp/d_{name}_b", *extra)
    out[name] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    print(name, "max weight difference between two identical runs:", out[name], flush=True)
json.dump(out, open(sys.argv[1], "w"))
PY
timeout 200 python3 /tmp/diag.py $R/determinism.json 2>&1 | grep -v Warn | tail -5
timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_train.py tests/test_bench.py > $R/tests_train.log 2>&1; echo "tests rc $?"; tail -2 $R/tests_train.log; grep -E "^(FAILED|ERROR)" $R/tests_train.log
