# session 30, on the 2-core development machine (torch 2.13.0+cpu): how long the trainer's
# "reading the data" takes for cifar10-fast from a warm cache: open_inputs, once per process, as
# `gpuaccel train` calls it. Usage: PYTHONPATH=<src> python read_inputs_cpu.py LABEL
import json
import sys
import time

import gpuaccel.cli  # noqa: F401  (the command's imports, before the clock)
from gpuaccel.data import resolved_spec
from gpuaccel.parallel import Distributed
from gpuaccel.train import TrainConfig
from gpuaccel.train.inputs import open_inputs
from gpuaccel.train.recipes import load_recipe

config = TrainConfig(**{**load_recipe("cifar10-fast"), "data": "/tmp/data/cifar10", "device": "cpu",
                        "monitor": False}).validate()
start = time.perf_counter()
config.data = resolved_spec(config.data)
open_inputs(config, dataset=None, train_data=None, eval_data=None, dist=Distributed.from_env())
print(json.dumps({"code": sys.argv[1], "seconds": round(time.perf_counter() - start, 3)}))
