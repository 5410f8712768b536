"""One process of a data-parallel run whose gradients are averaged by the step itself (one
all-reduce, what a captured step records on GPUs; run eagerly here: CPUs cannot capture),
instead of DDP.

    torchrun --nproc-per-node 2 tests/step_graph_worker.py RUN_DIR BATCH EPOCHS [BUCKET_MB GRAD_ACCUM]

BUCKET_MB: the gradients averaged in buckets of that size as the backward pass finishes them.
"""
import sys

import torch
from plain_models import end_worker

from gpuaccel import TrainConfig, Trainer
from gpuaccel.parallel import Distributed, GraphDataParallel

run_dir, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
bucket_mb, grad_accum = (float(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 4 else (None, 1)
dist = Distributed.from_env()
# the strategy the trainer picks on GPUs with --compile-mode reduce-overhead: no DDP, rank 0's
# weights everywhere, the gradients averaged inside the step
strategy = GraphDataParallel(torch.device("cpu"), dist.rank, dist.world_size, bucket_cap_mb=bucket_mb)
trainer = Trainer(TrainConfig(device="cpu", model="plain_models:plain_cnn", lr=0.05, batch_size=batch, epochs=epochs,
                              grad_accum=grad_accum, monitor=False, run_dir=run_dir), strategy=strategy, quiet=True)
trainer.fit()
if bucket_mb is not None:  # (what the test checks: the gradients did go in several buckets)
    print(f"rank {dist.rank}: {len(strategy.buckets.buckets)} buckets")
trainer.dist.close()
end_worker()
