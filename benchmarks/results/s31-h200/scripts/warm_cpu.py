# session 31: the warm-up of cifar10-fast (small batches) on the CPU, a fresh process each time
import os, sys, time
t0 = time.perf_counter()
import torch
from gpuaccel.train import TrainConfig, Trainer
from gpuaccel.train.recipes import load_recipe
cfg = load_recipe("cifar10-fast")
cfg = TrainConfig(**{**cfg, "data": "/tmp/data/cifar10", "device": "cpu", "monitor": False, "batch_size": 64, "eval_batch_size": 100})
tr = Trainer(cfg, quiet=True)
t1 = time.perf_counter()
w = tr.warm_up(evaluate=len(sys.argv) < 2)
print(os.environ.get("TORCH_CACHING_PRECOMPILE", "0"), f"to trainer {t1-t0:.2f} warm-up {w:.2f}", flush=True)
