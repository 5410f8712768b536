"""The CPU side of "train on the CPU, time it; on the GPU, time it; compare": each shipped
workload's model trained three ways on this machine's CPU, alternated in one process.

- ``plain``: the textbook PyTorch loop: ``DataLoader(TensorDataset, shuffle=True)``, the model,
  the optimizer, fp32, ``loss.backward()``, ``optimizer.step()`` (for ``shakespeare-gpt-vs-nanogpt``
  the model is nanoGPT's own, :class:`NanoGPT`, of the same size as gpuaccel's ``gpt``);
- ``prepared``: the same loop with the model, optimizer and loader through
  ``gpuaccel.Accelerator(device="cpu").prepare`` (and ``acc.autocast``, ``acc.backward``);
- ``trainer``: ``gpuaccel.Trainer`` on the same tensors, model, batch size and optimizer type
  (the training time of ``--warmup`` + ``--steps`` steps less that of ``--warmup`` steps).

Same model, batch and optimizer in every way; the data are random tensors of each workload's
shapes (speed does not depend on their values). Each way runs ``--steps`` steps after
``--warmup`` steps, ``--rounds`` times in turn; the table gives the median samples per second,
each way's ratio to plain of those medians, and the median of the per-round ratios (the ways
of a round ran back to back, so the machine's drift over the rounds cancels in those).

    python benchmarks/cpu_baseline/cpu_baseline.py --out benchmarks/cpu_baseline/results/cpu_baseline.json

Timings on a few shared cores swing several-fold under load: run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpuaccel
from gpuaccel.models import create_model


class NanoGPT(torch.nn.Module):
    """nanoGPT's model as its model.py writes it (LayerNorm, learned positions, biases, GELU MLP,
    tied head), at a given size: the plain loop a char-level GPT is compared with."""

    def __init__(self, vocab_size, context_length, layers, heads, width, dropout):
        super().__init__()
        nn = torch.nn
        self.heads, self.drop = heads, nn.Dropout(dropout)
        self.wte, self.wpe = nn.Embedding(vocab_size, width), nn.Embedding(context_length, width)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(width), attn=nn.Linear(width, 3 * width), proj=nn.Linear(width, width),
            ln2=nn.LayerNorm(width), fc=nn.Linear(width, 4 * width), out=nn.Linear(4 * width, width)))
            for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(width), nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.wte.weight
        self.dropout = dropout

    def forward(self, idx):
        b, t = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            q, k, v = block["attn"](block["ln1"](x)).split(x.shape[-1], 2)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
            x = x + self.drop(block["proj"](y.transpose(1, 2).reshape(b, t, -1)))
            x = x + self.drop(block["out"](F.gelu(block["fc"](block["ln2"](x)))))
        return self.head(self.ln_f(x))


def _images(n, channels, size, classes):
    return torch.randn(n, channels, size, size), torch.randint(0, classes, (n,))


# workload -> (model name, model arguments, data maker, batch, optimizer, loss, task)
def _workloads() -> dict:
    def tokens(n, vocab, length):
        return torch.randint(1, vocab, (n, length)), torch.randint(0, 2, (n,))

    def windows(n, vocab, length):
        x = torch.randint(0, vocab, (n, length + 1))
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def ratings(n, users, items):
        return torch.randint(0, users, (n,)), torch.randint(0, items, (n,)), 1 + 4 * torch.rand(n)

    def lm_loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())

    return {
        "digits-lenet5": ("lenet5", dict(num_classes=10, in_channels=1, image_size=8),
                          lambda: _images(2048, 1, 8, 10), 32, "sgd", F.cross_entropy, "classification"),
        "cifar10-fastnet": ("fastnet", dict(num_classes=10, in_channels=3, image_size=32),
                            lambda: _images(2048, 3, 32, 10), 256, "sgd", F.cross_entropy, "classification"),
        "shakespeare-gpt": ("gpt", dict(vocab_size=65, context_length=64, layers=4, heads=4, width=128, dropout=0.1),
                            lambda: windows(4096, 65, 64), 32, "adamw", lm_loss, "language_modelling"),
        # the plain loop with nanoGPT's own model of the same size (what a user would compare with)
        "shakespeare-gpt-vs-nanogpt": ("gpt", dict(vocab_size=65, context_length=64, layers=4, heads=4, width=128,
                                                   dropout=0.1),
                                       lambda: windows(4096, 65, 64), 64, "adamw", lm_loss, "language_modelling"),
        "sst2-transformer": ("text_transformer", dict(vocab_size=8000, num_classes=2, context_length=48, layers=2,
                                                      heads=4, width=128, dropout=0.1),
                             lambda: tokens(4096, 8000, 48), 256, "adamw", F.cross_entropy, "classification"),
        "fsdd-tcnn": ("audio_tcnn", dict(num_classes=10, sample_rate=8000),
                      lambda: (torch.randn(1024, 8000), torch.randint(0, 10, (1024,))), 128, "adamw", F.cross_entropy,
                      "classification"),
        "movielens-mf": ("matrix_factorization", dict(num_users=943, num_items=1682, rating_mean=3.5,
                                                      rating_range=[1, 5]),
                         lambda: ratings(80000, 943, 1682), 4096, "adamw", F.mse_loss, "regression"),
    }


def _optimizer(name, parameters, lr):
    return torch.optim.AdamW(parameters, lr=lr) if name == "adamw" else \
        torch.optim.SGD(parameters, lr=lr, momentum=0.9, nesterov=True)


NANOGPT_PLAIN = {"on": False}  # the plain way runs NanoGPT (the shakespeare-gpt-vs-nanogpt workload)


def _model(name, model_args):
    torch.manual_seed(0)
    return create_model(name, **model_args)


def loop(way: str, workload: tuple, data, warmup: int, steps: int) -> float:
    """Samples per second of ``steps`` steps of the plain or the prepared loop, after ``warmup``."""
    name, model_args, _, batch, optimizer_name, loss_fn, _ = workload
    model = _model(name, model_args)
    if way == "plain" and NANOGPT_PLAIN["on"]:
        torch.manual_seed(0)
        model = NanoGPT(**model_args)
    optimizer = _optimizer(optimizer_name, model.parameters(), 1e-3)
    loader = DataLoader(TensorDataset(*data), batch_size=batch, shuffle=True, drop_last=True)
    acc = None
    if way == "prepared":
        acc = gpuaccel.Accelerator(device="cpu", monitor=False)
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
    model.train()

    def batches():
        while True:
            yield from loader

    stream = batches()
    for i in range(warmup + steps):
        if i == warmup:
            start = time.perf_counter()
        *inputs, targets = next(stream)
        if acc is None:
            loss = loss_fn(model(*inputs), targets)
            loss.backward()
        else:
            with acc.autocast():
                loss = loss_fn(model(*inputs), targets)
            acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return steps * batch / (time.perf_counter() - start)


def trainer(workload: tuple, data, warmup: int, steps: int) -> float:
    """Samples per second of ``steps`` steps of gpuaccel.Trainer after ``warmup``: the training time
    of a run of ``warmup + steps`` steps less that of a run of ``warmup`` steps. (On a CPU the
    Trainer has no warm-up before its clock starts, so its first steps would count against it
    where the loops above leave them out.)"""
    name, model_args, _, batch, optimizer_name, loss_fn, task = workload
    n = len(data[0])
    held_out = tuple(t[:batch] for t in data)

    def training_seconds(total_steps: int) -> float:
        config = gpuaccel.TrainConfig(device="cpu", batch_size=batch, optimizer=optimizer_name, lr=1e-3, momentum=0.9,
                                      nesterov=optimizer_name == "sgd", weight_decay=0.0,
                                      epochs=total_steps / (n // batch), schedule="constant", warmup_epochs=0.0,
                                      eval_every=10**9, checkpoint_epochs=0, monitor=False, eval_batch_size=batch,
                                      run_dir=None, loader="auto")
        summary = gpuaccel.Trainer(config, model=_model(name, model_args), train_data=tuple(data),
                                   eval_data=held_out, task=task, quiet=True).fit()
        _remove(summary["run_dir"])
        return summary["train_seconds"]

    return steps * batch / (training_seconds(warmup + steps) - training_seconds(warmup))


def _remove(run_dir: str) -> None:
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(_workloads()), choices=list(_workloads()))
    ap.add_argument("--ways", nargs="+", default=["plain", "prepared", "trainer"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    workloads = _workloads()
    rows = []
    for key in args.workloads:
        workload = workloads[key]
        NANOGPT_PLAIN["on"] = key == "shakespeare-gpt-vs-nanogpt"
        torch.manual_seed(0)
        data = workload[2]()
        rates = {way: [] for way in args.ways}
        for r in range(args.rounds):
            order = args.ways if r % 2 == 0 else args.ways[::-1]  # alternate who goes first
            for way in order:
                rate = trainer(workload, data, args.warmup, args.steps) if way == "trainer" else \
                    loop(way, workload, data, args.warmup, args.steps)
                rates[way].append(round(rate, 1))
        row = {"workload": key, "model": workload[0], "batch": workload[3], "optimizer": workload[4],
               **{f"{way}_samples_per_second": statistics.median(v) for way, v in rates.items()},
               "runs": rates}
        for way in args.ways:
            if way != "plain" and "plain" in rates:
                row[f"{way}_vs_plain"] = round(statistics.median(rates[way]) / statistics.median(rates["plain"]), 3)
                # each round's ratio: the ways of one round ran back to back, so drift of the shared
                # machine over the rounds (several per cent here) cancels in them
                paired = [a / b for a, b in zip(rates[way], rates["plain"])]
                row[f"{way}_vs_plain_per_round"] = [round(x, 3) for x in paired]
                row[f"{way}_vs_plain_paired_median"] = round(statistics.median(paired), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result = {"device": "cpu", "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": "python benchmarks/cpu_baseline/cpu_baseline.py " + " ".join(
                  f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
                  if k != "out" and v is not None),
              "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
