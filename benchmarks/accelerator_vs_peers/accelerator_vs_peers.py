"""One plain training loop, written once below, run as plain PyTorch, under HF Accelerate,
under Lightning Fabric, and under gpuaccel.Accelerator without and with ``capture`` (the
whole step as one CUDA graph): images (or tokens) per second and peak memory on one GPU,
each configuration in its own process.

    python benchmarks/accelerator_vs_peers/accelerator_vs_peers.py --data /tmp/data/cifar10 --text tinyshakespeare.txt --out results.json
    python benchmarks/accelerator_vs_peers/accelerator_vs_peers.py --workload resnet50-synthetic --configs plain gpuaccel

Workloads:
  resnet18-cifar10    gpuaccel's ResNet-18 for 32 px on the CIFAR-10 training images (decoded
                      once into a TensorDataset), batch 512, bf16: launch-bound
  resnet50-synthetic  ResNet-50 at 224 px on 1,024 random images, batch 128, bf16: compute-bound
  gpt-shakespeare     the shakespeare-char GPT (6 layers, 6 heads, 384 wide, context 256) on
                      8,192 windows of tiny Shakespeare (``--text``), batch 64, bf16

Every configuration trains the same model from the same seed with SGD (Nesterov momentum),
from a ``DataLoader(TensorDataset, shuffle=True, drop_last=True)``, as the framework's
documentation shows it: plain moves each batch to the GPU itself; Accelerate and Fabric
prepare the loader; gpuaccel prepares it too (device-resident, since the tensors fit).
Nothing is compiled unless the configuration says so. After ``--warmup`` steps (which
include capture's warm-up and recording), ``--steps`` steps are timed between two CUDA
synchronisations.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = ("plain", "accelerate", "fabric", "gpuaccel", "gpuaccel-capture", "gpuaccel-capture-compiled")
WORKLOADS = {"resnet18-cifar10": ("resnet18", 512), "resnet50-synthetic": ("resnet50", 128),
             "gpt-shakespeare": ("gpt", 64)}


def build(workload: str, data: str | None):
    import torch
    from torch.utils.data import TensorDataset

    from gpuaccel.models import create_model

    name, batch = WORKLOADS[workload]
    torch.manual_seed(0)
    if workload == "resnet18-cifar10":
        from gpuaccel.data import open_dataset

        ds = open_dataset(data)
        images = torch.from_numpy(ds.train_images).float().div_(255)
        mean, std = images.mean((0, 2, 3), keepdim=True), images.std((0, 2, 3), keepdim=True)
        dataset = TensorDataset((images - mean) / std, torch.from_numpy(ds.train_labels).long())
        model = create_model(name, num_classes=10, in_channels=3, image_size=32)
    elif workload == "resnet50-synthetic":
        dataset = TensorDataset(torch.randn(1024, 3, 224, 224), torch.randint(0, 1000, (1024,)))
        model = create_model(name, num_classes=1000, in_channels=3, image_size=224)
    else:  # nanoGPT's shakespeare-char model on 8,192 random windows of 256 characters
        from gpuaccel.data.text import load_corpus

        corpus = load_corpus(Path(data))
        tokens = torch.from_numpy(corpus.train.astype("int64"))
        starts = torch.randint(0, len(tokens) - 257, (8192,))
        windows = torch.stack([tokens[i:i + 257] for i in starts.tolist()])
        dataset = TensorDataset(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())
        model = create_model(name, vocab_size=corpus.tokenizer.vocab_size, context_length=256, layers=6, heads=6,
                             width=384)
    return model, dataset, batch


def measure(config: str, workload: str, data: str | None, warmup: int, steps: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    model, dataset, batch = build(workload, data)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, drop_last=True)
    backward = lambda loss: loss.backward()  # noqa: E731 (each framework replaces these three)
    autocast = lambda: torch.autocast("cuda", torch.bfloat16)  # noqa: E731
    to_device = lambda x, y: (x.cuda(non_blocking=True), y.cuda(non_blocking=True))  # noqa: E731
    acc = None
    if config == "plain":
        model.cuda()
    elif config == "accelerate":
        from accelerate import Accelerator

        hf = Accelerator(mixed_precision="bf16")
        model, optimizer, loader = hf.prepare(model, optimizer, loader)
        backward, autocast, to_device = hf.backward, hf.autocast, lambda x, y: (x, y)
    elif config == "fabric":
        from lightning.fabric import Fabric

        fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(loader)
        backward, autocast, to_device = fabric.backward, fabric.autocast, lambda x, y: (x, y)
    else:
        import gpuaccel

        acc = gpuaccel.Accelerator(precision="bf16", compile=config.endswith("compiled"))
        model, optimizer, loader = acc.prepare(model, optimizer, loader)
        backward, autocast, to_device = acc.backward, acc.autocast, lambda x, y: (x, y)

    def step(x, y):  # the training step, the same in every configuration
        with autocast():
            loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())  # (for the GPT: every position)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if config.startswith("gpuaccel-capture"):
        step = acc.capture(step)

    def batches():
        while True:
            for x, y in loader:
                yield to_device(x, y)

    stream = batches()
    start = time.perf_counter()
    for _ in range(warmup):
        loss = step(*next(stream))
    torch.cuda.synchronize()
    warm_seconds = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step(*next(stream))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    unit = "tokens_per_second" if workload == "gpt-shakespeare" else "images_per_second"
    per_sample = 256 if workload == "gpt-shakespeare" else 1  # a window's tokens; an image counts one
    return {"config": config, "workload": workload, "batch": batch, "steps": steps, "seconds": round(seconds, 4),
            unit: round(steps * batch * per_sample / seconds, 1), "warmup_seconds": round(warm_seconds, 2),
            "final_loss": round(float(loss), 4), "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--data", help="the CIFAR-10 image folder (resnet18-cifar10)")
    ap.add_argument("--text", help="tiny Shakespeare's .txt (gpt-shakespeare)")
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=2, help="rounds over the configurations")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.one:
        config, workload = args.one.split("@")
        source = args.text if workload == "gpt-shakespeare" else args.data
        print(json.dumps(measure(config, workload, source, args.warmup, args.steps)))
        return
    results = []
    for repeat in range(args.repeats):
        for workload in args.workload:
            for config in args.configs:
                command = [sys.executable, __file__, "--one", f"{config}@{workload}", "--warmup", str(args.warmup),
                           "--steps", str(args.steps)] + (["--data", args.data] if args.data else []) \
                    + (["--text", args.text] if args.text else [])
                done = subprocess.run(command, capture_output=True, text=True, env=os.environ)
                if done.returncode != 0:
                    result = {"config": config, "workload": workload, "error": done.stderr.strip()[-600:]}
                else:
                    result = json.loads(done.stdout.strip().splitlines()[-1])
                result["repeat"] = repeat
                results.append(result)
                print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
