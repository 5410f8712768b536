"""One process of a data-parallel DLRM run: its embedding tables update themselves inside the
backward pass, so each process gathers every process's rows and gradients (models/dlrm.py).

    torchrun --nproc-per-node 2 tests/dlrm_worker.py RUN_DIR BATCH ddp|graph
"""
import sys

import torch
from plain_models import click_task, clicks, end_worker

from gpuaccel import TrainConfig, Trainer, create_model
from gpuaccel.parallel import Distributed, GraphDataParallel


def train(run_dir: str, batch: int, rank: int = 0, strategy=None) -> Trainer:
    torch.manual_seed(rank)  # different tables on each process: the start must give every one rank 0's
    model = create_model("dlrm", table_sizes=[50, 30, 20], dim=8, bottom=[16], top=[32], table_lr=0.1, required=())
    dense, sparse, labels = clicks()
    config = TrainConfig(batch_size=batch, epochs=2, optimizer="adamw", lr=3e-3, weight_decay=0.0, device="cpu",
                         monitor=False, run_dir=run_dir)
    trainer = Trainer(config, model=model, train_data=(dense[:3584], sparse[:3584], labels[:3584]),
                      eval_data=(dense[3584:], sparse[3584:], labels[3584:]), task=click_task(), strategy=strategy,
                      quiet=True)
    trainer.fit()
    return trainer


if __name__ == "__main__":
    run_dir, batch, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist = Distributed.from_env()
    # "graph": the strategy the trainer picks on GPUs for a captured step (run eagerly here); else DDP
    chosen = GraphDataParallel(torch.device("cpu"), dist.rank, dist.world_size) if kind == "graph" else None
    train(run_dir, batch, dist.rank, chosen).dist.close()
    end_worker()
