"""Is a training step bound by the host or by the GPU? Per step: the host time to issue it
and the time until the GPU has finished it, over N steps after warm-up (and the same for
the loader alone). Issue time well under done time: the GPU sets the pace; about equal:
the host does (or the launch queue is full).

    python benchmarks/resnet50/step_host_vs_gpu.py RECIPE [OVERRIDES_JSON] [STEPS] [DATA]

e.g. `python benchmarks/resnet50/step_host_vs_gpu.py cifar10-fast '{"step_graph": false}' 100`.
DATA defaults to /tmp/data/cifar10. Prints one JSON object (milliseconds per step).
"""
import json
import sys
import time

from gpuaccel.device import synchronize
from gpuaccel.train.config import TrainConfig
from gpuaccel.train.recipes import load_recipe
from gpuaccel.train.trainer import Trainer

overrides = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
n = int(sys.argv[3]) if len(sys.argv) > 3 else 100
data = sys.argv[4] if len(sys.argv) > 4 else "/tmp/data/cifar10"
cfg = TrainConfig(**{**load_recipe(sys.argv[1]), "data": data, "monitor": False, **overrides})
t = Trainer(cfg, quiet=True)
t.warm_up()
stream = iter(b for e in range(1000) for b in t.train_loader.batches(e))
out = {}


def steps(k, parts):
    for _ in range(k):
        x, y = next(stream)
        if "step" in parts:
            t.train_step(x, y)
        if "fb" in parts:
            t.strategy.forward_backward(t._forward_backward(1), x, y, sync=True)


out["step_graph"] = t.step_graph_off is None
for name, parts in (("full", ("step",)), ("load_only", ()), ("load_fb", ("fb",)), ("full_again", ("step",))):
    if name == "load_fb" and t.step_graph_off is None:
        continue  # the graph does forward, backward and update together
    try:
        steps(3, parts)
        synchronize(t.device)
        t0 = time.perf_counter()
        steps(n, parts)
        t1 = time.perf_counter()
        synchronize(t.device)
        t2 = time.perf_counter()
        out[name] = {"issue_ms": round((t1 - t0) * 1000 / n, 3), "done_ms": round((t2 - t0) * 1000 / n, 3)}
    except Exception as exc:
        out[name] = repr(exc)[:300]
    t.optimizer.zero_grad(set_to_none=True)
print(json.dumps(out))
