"""Where a recipe's captured training step spends its GPU time, on one GPU or on each of N
(under torch.distributed.run): the whole step, and its parts each captured and replayed on
their own, timed with CUDA events after the recipe's own warm-up.

    python benchmarks/scaling/step_parts.py --recipe cifar10-fast --data /tmp/data/cifar10 \\
        --batch-sizes 384 768 1536 --out one_gpu.json
    python -m torch.distributed.run --standalone --nproc-per-node 4 benchmarks/scaling/step_parts.py \\
        --recipe cifar10-fast --data /tmp/data/cifar10 --batch-sizes 1536 --out four_gpus.json

Parts: ``step`` (the whole step graph, as training replays it, on one batch), ``loop`` (the
step on each batch the training loader yields next, its preparation included, as the training
loop runs them), ``optimizer`` (the optimizer's update alone), ``reduce`` (with several processes:
the gradient all-reduce alone). Each is replayed ``--replays`` times in blocks of ``--block``; the
JSON holds every block's GPU time per replay and their median, and the host's: how long issuing
the block took before waiting for the GPU (a host time as long as the GPU's means the host paces
the step). ``--batch-sizes`` are the recipe's batch sizes (global where it sets
``global_batch``); ``--set key=value`` overrides any other setting, e.g. ResNet-18 with the
step graph and no recipe:

    python benchmarks/scaling/step_parts.py --recipe none --data /tmp/data/cifar10 --batch-sizes 512 \
        --set model=resnet18 lr=0.2 crop_padding=4 flip=random compile=true compile_mode=reduce-overhead \
        --out resnet18.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.distributed as dist

import gpuaccel
from gpuaccel.bench.timing import graph_replay
from gpuaccel.train.recipes import load_recipe


def parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def replay_times(replay, replays: int, block: int) -> dict[str, list[float]]:
    """Milliseconds per replay of each block of ``block`` replays: on the GPU (CUDA events around
    the block) and on the host (until the block's last replay was issued)."""
    times = {"gpu": [], "host": []}
    for _ in range(max(1, replays // block)):
        if dist.is_initialized():
            dist.barrier()  # (the processes start each block together: a collective waits for the slowest)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        issued = time.perf_counter()
        for _ in range(block):
            replay()
        end.record()
        issued = time.perf_counter() - issued
        end.synchronize()
        times["gpu"].append(round(start.elapsed_time(end) / block, 4))
        times["host"].append(round(1e3 * issued / block, 4))
    return times


def measure(settings: dict, replays: int, block: int) -> dict:
    torch._dynamo.reset()  # (each batch size compiles its own graphs)
    config = gpuaccel.TrainConfig.from_dict({**settings, "run_dir": tempfile.mkdtemp()})
    trainer = gpuaccel.Trainer(config, quiet=True)
    trainer.warm_up(evaluate=False)
    inputs, targets = trainer.task.split(next(iter(trainer.train_loader.batches(0))))
    parts = {"step": replay_times(lambda: trainer.step([(inputs, targets)]), replays, block)}
    loader = trainer.train_loader
    batches = itertools.chain.from_iterable(loader.batches(epoch) for epoch in itertools.count())
    parts["loop"] = replay_times(lambda: trainer.step([trainer.task.split(next(batches))]), replays, block)
    parts["optimizer"] = replay_times(graph_replay(trainer.stepper.step), replays, block)
    if trainer.strategy.reduce_gradients is not None:
        params = list(trainer.model.parameters())
        parts["reduce"] = replay_times(graph_replay(lambda: trainer.strategy.reduce_gradients(params)), replays, block)
    trainer.step.release()  # (graphs holding a recorded all-reduce must go before the process group)
    return {"batch_size": config.loop.batch_size, "batch_per_process": trainer.batch_per_process,
            "strategy": trainer.strategy.describe(),
            "ms_per_replay": {name: {"median": statistics.median(t["gpu"]), "blocks": t["gpu"],
                                     "host_median": statistics.median(t["host"]), "host_blocks": t["host"]}
                              for name, t in parts.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="cifar10-fast", help="a recipe's name or file; 'none': the defaults and --set")
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch-sizes", type=int, nargs="+", required=True)
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    ap.add_argument("--replays", type=int, default=400)
    ap.add_argument("--block", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    settings = {**(load_recipe(args.recipe) if args.recipe != "none" else {}), "data": args.data,
                **{k: parse_value(v) for k, v in (item.split("=", 1) for item in args.set)}}
    rows = [measure({**settings, "batch_size": b}, args.replays, args.block) for b in args.batch_sizes]
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    result = {"command": " ".join(sys.argv), "recipe": args.recipe, "settings": args.set, "processes": world,
              "rank": rank, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "rows": rows}
    out = args.out if world == 1 else args.out.replace(".json", f".rank{rank}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    if rank == 0:
        for row in rows:
            print(row["batch_size"], row["batch_per_process"],
                  {k: (v["median"], v["host_median"]) for k, v in row["ms_per_replay"].items()}, flush=True)
    if dist.is_initialized():
        torch.cuda.synchronize()
        gc.collect()  # (the recorded graphs, before their process group)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
