"""One process of a data-parallel run whose steps go through the step graph's code (run eagerly:
CPUs cannot capture) with the gradient all-reduce it records on GPUs, instead of DDP.

    torchrun --nproc-per-node 2 tests/step_graph_worker.py RUN_DIR BATCH EPOCHS
"""
import contextlib
import sys

import torch

from gpuaccel import TrainConfig, Trainer
from gpuaccel.parallel import Distributed, GraphDataParallel
from gpuaccel.train.step_graph import StepGraph

run_dir, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist = Distributed.from_env()
# the strategy the trainer picks on GPUs with --compile-mode reduce-overhead: no DDP, rank 0's
# weights everywhere, the gradients averaged inside the step
trainer = Trainer(TrainConfig(device="cpu", model="plain_models:plain_cnn", lr=0.05, batch_size=batch, epochs=epochs,
                              monitor=False, run_dir=run_dir),
                  strategy=GraphDataParallel(torch.device("cpu"), dist.rank, dist.world_size), quiet=True)
trainer.step_graph = StepGraph(trainer.model, trainer.forward, trainer.optimizer, loss_fn=trainer.task.loss,
                               autocast=contextlib.nullcontext, reduce_gradients=trainer.strategy.reduce_gradients)
trainer.step_graph.prepare()
trainer.fit()
trainer.dist.close()
