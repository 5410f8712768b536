"""One process of data-parallel runs whose gradients are averaged by the step itself (one
all-reduce, what a captured step records on GPUs; run eagerly here: CPUs cannot capture),
instead of DDP: each RUN given, one after the other in one launch (a launch costs seconds on a CPU).

    torchrun --nproc-per-node 2 tests/step_graph_worker.py EPOCHS RUN [RUN ...]

RUN: ``DIR:BATCH`` (one all-reduce after the backward pass) or ``DIR:BATCH:BUCKET_MB:GRAD_ACCUM``
(the gradients averaged in buckets of that size as the backward pass finishes them).
"""
import sys

import torch
from plain_models import end_worker

from gpuaccel import TrainConfig, Trainer
from gpuaccel.parallel import Distributed, GraphDataParallel

epochs = int(sys.argv[1])
dist = Distributed.from_env()
for run in sys.argv[2:]:
    run_dir, batch, *averaging = run.split(":")
    bucket_mb, grad_accum = (float(averaging[0]), int(averaging[1])) if averaging else (None, 1)
    # the strategy the trainer picks on GPUs with --compile-mode reduce-overhead: no DDP, rank 0's
    # weights everywhere, the gradients averaged inside the step
    strategy = GraphDataParallel(torch.device("cpu"), dist.rank, dist.world_size, bucket_cap_mb=bucket_mb)
    trainer = Trainer(TrainConfig(device="cpu", model="plain_models:plain_cnn", lr=0.05, batch_size=int(batch),
                                  epochs=epochs, grad_accum=grad_accum, monitor=False, run_dir=run_dir),
                      strategy=strategy, quiet=True)
    trainer.fit()
    if bucket_mb is not None:  # (what the test checks: the gradients did go in several buckets)
        print(f"{run_dir}: rank {dist.rank}: {len(strategy.buckets.buckets)} buckets", flush=True)
trainer.dist.close()
end_worker()
