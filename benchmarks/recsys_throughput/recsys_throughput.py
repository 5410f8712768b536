"""DLRM training throughput at recommender scale, on one GPU, on synthetic data shaped like the
Criteo click logs: 13 dense features, 26 sparse features with MLPerf's Criteo table sizes
capped at 10 M rows (54.1 M rows, 25.8 GiB in fp32), embedding dimension 128, batch 64k, ids drawn with a
heavy head (id = rows x u^3: a few rows take most lookups, as in click logs).

Three configurations, each in its own process:

  baseline  plain PyTorch written here: 26 ``nn.EmbeddingBag(sparse=True)`` tables updated by
            ``torch.optim.SparseAdam``; bottom MLP 512-256-128, dot interactions, top MLP
            1024-1024-512-256-1 with fused Adam; bf16 autocast; the dense part compiled;
  model     gpuaccel's ``dlrm`` (one fused table, row-wise Adagrad inside the backward pass) in
            the same plain loop, the dense part compiled, fused AdamW for the MLPs;
  trainer   the same model through ``gpuaccel.Trainer`` with the whole step as one CUDA graph.

Reported: records per second over the timed steps (after warm-up; the device synchronised
before each clock read), the median of ``--repeats`` timed windows.

    python benchmarks/recsys_throughput/recsys_throughput.py --out results.json [--which baseline,model,trainer]
        [--batch 65536 --steps 30 --warmup 10 --repeats 3 --max-rows 10000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone

import torch
import torch.nn as nn
import torch.nn.functional as F

# MLPerf DLRM's Criteo Terabyte table sizes (rows per sparse feature), before capping
CRITEO_SIZES = [39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10, 2208,
                11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36]
BOTTOM, TOP, DIM, DENSE = [512, 256], [1024, 1024, 512, 256], 128, 13


def click_logits(dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
    """The synthetic records' true click log-odds: a fixed linear function of the dense features
    plus, for each table, a fixed effect of the id (a hash of table and id, uniform in +-0.44),
    so that a model can learn who clicks (hot ids are seen often) and a held-out loss says how
    well it did; the labels are drawn from it. Logits spread about 1.5 around logit(0.25)."""
    weights = torch.linspace(-1.0, 1.0, DENSE, device=dense.device) * (0.7 / (DENSE / 3) ** 0.5)
    table = torch.arange(1, sparse.shape[1] + 1, device=sparse.device)
    mask = 0x7FFFFFFF
    h = (sparse * 0x9E3779B1 + table * 0x85EBCA77) & mask  # (a 32-bit multiplicative hash, kept in int64)
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & mask
    h = h ^ (h >> 12)
    effects = (h.double() / 2 ** 31 * 2 - 1) * 0.44
    return dense.double() @ weights.double() + effects.sum(1) - 1.1


def synthetic_batches(sizes, batch, count, device, seed=0):
    """``count`` batches of Criteo-shaped records (dense features, ids, labels drawn from
    :func:`click_logits`)."""
    g = torch.Generator(device).manual_seed(seed)
    out = []
    for _ in range(count):
        dense = torch.randn(batch, DENSE, device=device, generator=g)
        u = torch.rand(batch, len(sizes), device=device, generator=g)
        sparse = (u ** 3 * torch.tensor(sizes, device=device)).long().clamp_max(torch.tensor(sizes, device=device) - 1)
        # one float32 uniform per record, as when the labels were random: the generator's later draws,
        # so every batch's dense features and ids, stay what they were
        clicked = torch.rand(batch, device=device, generator=g) < torch.sigmoid(click_logits(dense, sparse)).float()
        out.append((dense, sparse, clicked.float()))
    return out


def label_losses(dense: torch.Tensor, sparse: torch.Tensor, labels: torch.Tensor) -> dict:
    """What a held-out loss is to be read against: the loss of the true click probabilities (the
    floor no model beats on average) and of a constant prediction of the click rate (what a model
    that learnt nothing gets)."""
    rate = labels.double().mean()
    constant = F.binary_cross_entropy(rate.expand_as(labels), labels.double())
    floor = F.binary_cross_entropy_with_logits(click_logits(dense, sparse), labels.double())
    return {"floor_loss": round(float(floor), 5), "constant_loss": round(float(constant), 5),
            "click_rate": round(float(rate), 4)}


def mlp(sizes, last_relu):
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class BaselineDLRM(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.tables = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in sizes)
        self.bottom = mlp([DENSE, *BOTTOM, DIM], True)
        vectors = len(sizes) + 1
        self.register_buffer("pairs", torch.triu_indices(vectors, vectors, 1))
        self.top = mlp([DIM + vectors * (vectors - 1) // 2, *TOP, 1], False)
        self.dense_part = torch.compile(self._dense_part)

    def _dense_part(self, dense, embedded):
        x = self.bottom(dense)
        vectors = torch.cat([x.unsqueeze(1), embedded.to(x.dtype)], 1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([x, products], 1))[:, 0]

    def forward(self, dense, sparse):
        embedded = torch.stack([t(sparse[:, k:k + 1]) for k, t in enumerate(self.tables)], 1)
        return self.dense_part(dense, embedded)


def timed_loop(step, batches, args) -> dict:
    for i in range(args.warmup):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    rates = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for i in range(args.steps):
            step(*batches[i % len(batches)])
        torch.cuda.synchronize()
        rates.append(args.steps * args.batch / (time.perf_counter() - start))
    return {"records_per_second": statistics.median(rates), "windows": rates}


def run_baseline(sizes, args) -> dict:
    model = BaselineDLRM(sizes).cuda()
    sparse_opt = torch.optim.SparseAdam(list(model.tables.parameters()), lr=1e-3)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("tables")]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3, fused=True)

    def step(dense, sparse, labels):
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.binary_cross_entropy_with_logits(model(dense, sparse).float(), labels)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad(set_to_none=True)
        dense_opt.zero_grad(set_to_none=True)

    return timed_loop(step, synthetic_batches(sizes, args.batch, 8, "cuda"), args)


def run_model(sizes, args) -> dict:
    from gpuaccel.models import create_model

    model = create_model("dlrm", table_sizes=sizes, required=()).cuda()
    params = [p for p in model.parameters() if not getattr(p, "updated_in_backward", False)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0, fused=True)
    compiled = torch.compile(model)

    def step(dense, sparse, labels):
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.binary_cross_entropy_with_logits(compiled(dense, sparse).float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return timed_loop(step, synthetic_batches(sizes, args.batch, 8, "cuda"), args)


def run_trainer(sizes, args) -> dict:
    import gpuaccel
    from gpuaccel.models import create_model
    from gpuaccel.tasks import CustomTask

    batches = synthetic_batches(sizes, args.batch, args.warmup + args.steps * args.repeats, "cuda")
    train = tuple(torch.cat([b[k] for b in batches]) for k in range(3))
    held = synthetic_batches(sizes, args.batch, 1, "cuda", seed=1)[0]
    config = gpuaccel.TrainConfig(
        batch_size=args.batch, eval_batch_size=args.batch,
        epochs=1, optimizer="adamw", lr=1e-3, weight_decay=0.0, schedule="constant", warmup_epochs=0.0,
        compile=True, compile_mode="reduce-overhead", eval_every=10 ** 9, monitor=False,
        checkpoint_seconds=10 ** 9, run_dir=tempfile.mkdtemp(dir="/tmp"))
    summary = gpuaccel.Trainer(config, model=create_model("dlrm", table_sizes=sizes, required=()), train_data=train, eval_data=held,
                               task=CustomTask(lambda out, y: F.binary_cross_entropy_with_logits(out.float(), y)),
                               quiet=True).fit()
    return {"records_per_second": summary["samples_per_second"], "train_seconds": summary["train_seconds"],
            "warmup_seconds": summary["warmup_seconds"], "step_graph": summary["step_graph"],
            "steps": summary["steps"], "held_out": {"loss": summary["metrics"]["loss"], **label_losses(*held)}}


RUNNERS = {"baseline": run_baseline, "model": run_model, "trainer": run_trainer}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", default="baseline,model,trainer")
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-rows", type=int, default=10_000_000)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: run this configuration, print JSON
    ap.add_argument("--out")
    args = ap.parse_args()
    sizes = [min(n, args.max_rows) for n in CRITEO_SIZES]
    if args.one:
        torch.manual_seed(0)
        result = RUNNERS[args.one](sizes, args)
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
        print("RESULT " + json.dumps(result))
        return
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "batch": args.batch,
              "table_rows": sizes, "total_rows": sum(sizes), "dim": DIM, "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats, "runs": {}}
    for name in args.which.split(","):
        child = subprocess.run([sys.executable, __file__, "--one", name, "--batch", str(args.batch), "--steps",
                                str(args.steps), "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                                "--max-rows", str(args.max_rows)], capture_output=True, text=True)
        line = next((ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")), None)
        report["runs"][name] = json.loads(line[7:]) if line else {"error": child.stderr.strip()[-2000:]}
        shown = report["runs"][name]
        print(f"{name:9s} " + (f"{shown['records_per_second'] / 1e6:.2f} M records/s, peak memory "
                               f"{shown['peak_memory_gib']:.1f} GiB" if "error" not in shown else shown["error"][-600:]),
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    base = report["runs"].get("baseline", {}).get("records_per_second")
    for name, run in report["runs"].items():
        if base and "records_per_second" in run and name != "baseline":
            print(f"{name} / baseline: {run['records_per_second'] / base:.2f}x")


if __name__ == "__main__":
    main()
