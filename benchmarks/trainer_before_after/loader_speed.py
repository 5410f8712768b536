"""A loader's own cost per batch, two source trees alternated: what a change to a loader costs,
without the model's step and the host's noise around it.

    python benchmarks/trainer_before_after/loader_speed.py --old SRC_BEFORE --new src --case sst2 --sst2 SST2
    python benchmarks/trainer_before_after/loader_speed.py --old SRC_BEFORE --new src --case prepared
    python benchmarks/trainer_before_after/loader_speed.py --old SRC_BEFORE --new src --case trainer-dataloader

Cases:
  sst2      the sst2 recipe's training loader (batch 512, sentences cut to their longest) over
            SST-2's train.tsv
  prepared  ``Accelerator.prepare`` of a shuffled DataLoader over MNIST-sized tensors (batch 64):
            the loader the ported pytorch/examples mnist script iterates
  trainer-dataloader
            the same DataLoader given to the Trainer (``train_data=``): the loader it trains from

Each tree runs in ``--rounds`` processes of its own (alternated, who goes first changing), each
serving ``--epochs`` epochs on the GPU (the first two not counted); an epoch is timed between two
synchronisations and divided by its batches. Prints and writes (``--out``) microseconds per batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def sst2_loader(data: str, device):
    from gpuaccel.data.sentences import load_sentences

    d = load_sentences(Path(data), tokenizer="word", max_tokens=256, cache_dir=None)
    try:
        from gpuaccel.kinds.sentences import sentence_loader
    except ImportError:  # (a tree from before the kinds' loaders were resident loaders with an order)
        from gpuaccel.data.sentences import SentenceLoader as sentence_loader
    loader = sentence_loader(d.train_ids, d.train_lengths, d.train_labels, batch_size=512, device=device, train=True,
                             seed=1)
    return lambda epoch: loader.batches(epoch)


def mnist_sized_dataloader():
    """A shuffled DataLoader over 60,000 MNIST-sized tensors, batch 64 (the ported mnist script's)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    tensors = TensorDataset(torch.randn(60000, 1, 28, 28), torch.randint(0, 10, (60000,)))
    return DataLoader(tensors, batch_size=64, shuffle=True)


def prepared_loader(data: str, device):
    import gpuaccel

    loader = gpuaccel.Accelerator(monitor=False).prepare(mnist_sized_dataloader())
    return lambda epoch: iter(loader)


def trainer_loader(data: str, device):
    from gpuaccel.runtime.loaders import user_loader

    loader = user_loader(mnist_sized_dataloader(), batch_size=64, device=device, train=True)
    return lambda epoch: loader.batches(epoch)


def one_tree(case: str, data: str, epochs: int) -> list[float]:
    import torch

    device = torch.device("cuda")
    batches_of = {"sst2": sst2_loader, "prepared": prepared_loader,
                  "trainer-dataloader": trainer_loader}[case](data, device)
    per_batch = []
    for epoch in range(epochs):
        torch.cuda.synchronize()
        start, count = time.perf_counter(), 0
        for _ in batches_of(epoch):
            count += 1
        torch.cuda.synchronize()
        per_batch.append((time.perf_counter() - start) / count * 1e6)
    return per_batch[2:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", required=True)
    ap.add_argument("--case", choices=["sst2", "prepared", "trainer-dataloader"], required=True)
    ap.add_argument("--sst2", default="", help="SST-2's folder (case sst2)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # (a tree's own process)
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.one:
        sys.path.insert(0, args.one)
        print(json.dumps(one_tree(args.case, args.sst2, args.epochs)))
        return
    trees = {"old": str(Path(args.old).resolve()), "new": str(Path(args.new).resolve())}
    values = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            done = subprocess.run([sys.executable, __file__, "--old", args.old, "--new", args.new, "--case", args.case,
                                   "--sst2", args.sst2, "--epochs", str(args.epochs), "--one", trees[name]],
                                  capture_output=True, text=True, check=True)
            values[name] += json.loads(done.stdout.strip().splitlines()[-1])
    import torch

    result = {"meta": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv)},
              "microseconds_per_batch": {name: {"median": round(statistics.median(v), 2), "min": round(min(v), 2),
                                                "max": round(max(v), 2), "values": [round(x, 2) for x in v]}
                                         for name, v in values.items()}}
    print(json.dumps(result["microseconds_per_batch"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
