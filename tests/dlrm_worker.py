"""One process of a data-parallel DLRM run: its embedding tables update themselves inside the
backward pass, sharded across the processes (whole tables) or replicated on each, which then
gathers every process's rows and gradients (models/dlrm.py).

    torchrun --nproc-per-node 2 tests/dlrm_worker.py RUN_DIR BATCH ddp|graph|graph-chunks|ddp-replicated|ema|tables

tables: the sharded tables' own checks in one process group (their updates, then their state).
Several training kinds, comma-separated, run one after the other in one launch (a launch costs
seconds on a CPU), each into RUN_DIR/KIND.
"""
import sys

import torch
from plain_models import click_task, clicks, end_worker

from gpuaccel import GpuaccelError, TrainConfig, Trainer, create_model
from gpuaccel.parallel import DataParallel, Distributed, GraphDataParallel


def train(run_dir: str, batch: int, rank: int = 0, strategy=None, exchange_chunks: int | None = None,
          **settings) -> Trainer:
    torch.manual_seed(rank)  # different tables on each process: the start must give every one rank 0's
    model = create_model("dlrm", table_sizes=[50, 30, 20], dim=8, bottom=[16], top=[32], table_lr=0.1,
                         exchange_chunks=exchange_chunks, required=())
    dense, sparse, labels = clicks()
    # 511 held-out samples in batches of 255: one process evaluates 256 (a batch of 255 and one of
    # 1), the other 255 (one batch): sharded tables pad the batches and run a blank pass
    config = TrainConfig(batch_size=batch, epochs=2, optimizer="adamw", lr=3e-3, weight_decay=0.0, device="cpu",
                         monitor=False, run_dir=run_dir, eval_batch_size=255, **settings)
    trainer = Trainer(config, model=model, train_data=(dense[:3584], sparse[:3584], labels[:3584]),
                      eval_data=(dense[3584:4095], sparse[3584:4095], labels[3584:4095]), task=click_task(),
                      strategy=strategy, quiet=True)
    trainer.fit()
    return trainer


def state_round_trip(run_dir: str) -> None:
    """Sharded tables: state_dict() gives the whole tables, and loading whole tables keeps this
    process's; RUN_DIR/state.pt gets the state read back after loading known values."""
    from gpuaccel.parallel.data_parallel import share_backward_updates

    model = create_model("dlrm", table_sizes=[50, 30, 20], dim=8, bottom=[16], top=[32], required=())
    share_backward_updates(model, shard_tables=True)
    whole = model.tables.state_dict()
    assert whole["weight"].shape == (100, 8) and whole["accumulator"].shape == (100,), whole["weight"].shape
    known = {"weight": torch.arange(800.0).view(100, 8), "accumulator": torch.arange(100.0)}
    model.tables.load_state_dict(known)
    back = model.tables.state_dict()
    if torch.distributed.get_rank() == 0:
        torch.save({k: back[k] for k in known}, f"{run_dir}/state.pt")


def updated_rows(batch: int) -> None:
    """Sharded tables: each process updates the rows of its own tables for every process's ids,
    and never the spare row its blank slots look up (asserted here)."""
    from gpuaccel.parallel.data_parallel import share_backward_updates

    world = torch.distributed.get_world_size()
    model = create_model("dlrm", table_sizes=[50, 30, 20], dim=8, bottom=[16], top=[32], required=())
    share_backward_updates(model, shard_tables=True)
    tables, given = model.tables, []
    # (the update's second half, which every path ends with: one exchange or several chunks)
    update = tables.update_from_sums
    tables.update_from_sums = lambda rows: (given.append(rows.clone()), update(rows))
    dense, sparse, _ = clicks()
    rank = torch.distributed.get_rank()
    model(dense[rank * batch:(rank + 1) * batch], sparse[rank * batch:(rank + 1) * batch]).sum().backward()
    (rows,) = given
    spare = tables.weight.shape[0] - 1
    assert rows.numel() == world * batch * tables.tables_here, (rows.numel(), tables.tables_here)
    assert not (rows == spare).any(), "the spare row was updated"


if __name__ == "__main__":
    run_dir, batch, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist = Distributed.from_env()
    if kind == "tables":
        torch.distributed.init_process_group("gloo")
        updated_rows(batch)
        state_round_trip(run_dir)
        end_worker()
    # "ddp": what the trainer picks (DDP, the tables sharded); "graph": what it picks on GPUs for a
    # captured step (run eagerly here); "ddp-replicated": the Accelerator's way; "ema": refused
    where = dict(device=torch.device("cpu"), rank=dist.rank, world_size=dist.world_size)
    kinds = kind.split(",")
    trainer = None
    for kind in kinds:
        # "graph-chunks": "graph" with each exchange of rows and gradients in 2 chunks of the records
        # (the model's own choice otherwise: 4 chunks on 4 processes, 1 on 2)
        strategy = {"graph": GraphDataParallel(**where, shard_tables=True),
                    "graph-chunks": GraphDataParallel(**where, shard_tables=True),
                    "ddp-replicated": DataParallel(**where)}.get(kind)
        try:
            trainer = train(f"{run_dir}/{kind}" if len(kinds) > 1 else run_dir, batch, dist.rank, strategy,
                            exchange_chunks=2 if kind == "graph-chunks" else None,
                            **({"ema": 0.99} if kind == "ema" else {}))
        except GpuaccelError as error:
            print(f"rank {dist.rank} refused: {error}", flush=True)
    if trainer is not None:
        trainer.dist.close()
    end_worker()
