import sys, json, tempfile, statistics
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, "benchmarks")
from int8_latency import latency_ms
from gpuaccel.deploy import export, load_trained
from gpuaccel.deploy.quantize import calibration_sample, quantize_int8
from gpuaccel.deploy.runners import load_runner
from gpuaccel.deploy.bench import measure, torch_call
t = load_trained("/tmp/q"); data = t.load_data(None, "no data")
calib = calibration_sample(data.train_images, 256)
w = Path(tempfile.mkdtemp())
fp = export(t, "onnx", w / "model.onnx", dynamic_batch=True)
q = quantize_int8(fp, w / "model.int8.onnx", calib)
(w / "model.int8.onnx.json").write_text((w / "model.onnx.json").read_text())
x = np.random.default_rng(0).random((1, 3, 32, 32), dtype=np.float32)
mk = lambda b: np.random.rand(b, 3, 32, 32).astype(np.float32)
res = {}
res["session fp32"] = latency_ms(fp, 2, x, 200); res["session int8"] = latency_ms(q, 2, x, 200)
r32, r8 = load_runner(fp), load_runner(q)
res["measure fp32"] = measure(r32, mk, batches=())["latency_p50_ms"]; res["measure int8"] = measure(r8, mk, batches=())["latency_p50_ms"]
m = t.module.eval(); measure(torch_call(m, torch.device("cpu")), lambda b: torch.rand(b, 3, 32, 32), batches=(64,))
res["after torch: measure fp32"] = measure(r32, mk, batches=())["latency_p50_ms"]; res["after torch: measure int8"] = measure(r8, mk, batches=())["latency_p50_ms"]
print(json.dumps(res, indent=1))
