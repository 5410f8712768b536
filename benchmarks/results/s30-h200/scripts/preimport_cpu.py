# session 30, on the 2-core development machine (torch 2.13.0+cpu): from process start to a built Trainer for cifar10-fast (device cpu), with or without importing Dynamo and Inductor on a thread
# usage: PYTHONPATH=src python benchmarks/results/s30-h200/scripts/preimport_cpu.py plain|thread  (the JPEG folder unpacked under /tmp/data/cifar10, its cache warm)
import sys, time, threading
t0 = time.perf_counter()
import torch
import gpuaccel.cli
from gpuaccel.train import TrainConfig, Trainer
from gpuaccel.train.recipes import load_recipe
t1 = time.perf_counter()
if sys.argv[1] == "thread":
    def pre():
        import torch._dynamo  # noqa
        import torch._inductor.compile_fx  # noqa
    th = threading.Thread(target=pre, daemon=True); th.start()
cfg = load_recipe("cifar10-fast")
cfg = TrainConfig(**{**cfg, "data": "/tmp/data/cifar10", "device": "cpu", "monitor": False})
tr = Trainer(cfg, quiet=True)
t2 = time.perf_counter()
import torch._inductor.compile_fx
t3 = time.perf_counter()
print(sys.argv[1], f"imports {t1-t0:.2f} trainer {t2-t1:.2f} compile_fx {t3-t2:.2f} total {t3-t0:.2f}", {k: round(v, 2) for k, v in tr.phases.table().items()})
