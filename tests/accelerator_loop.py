"""A plain PyTorch training loop, with or without gpuaccel.Accelerator (the lines marked ACC are
the changes), run by tests/test_accelerator.py in one process or under torchrun.

    python tests/accelerator_loop.py OUT.pt {plain|acc|acc-accumulate|acc-capture|acc-captured} GLOBAL_BATCH STEPS
        [--no-resident]
    python tests/accelerator_loop.py OUT.pt fsdp-resume

acc-capture runs the step through ``acc.capture`` (one CUDA graph on a GPU; on the CPU the
step runs as it is); acc-captured accumulates two micro-batches in nanoGPT's shape, through
``acc.captured``, its batches fetched halfway through each micro-step and DDP's all-reduce
kept for the last one by ``require_backward_grad_sync``. GPUACCEL_LOOP_DEVICE picks the device
(default cpu).
"""
import contextlib
import os
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import gpuaccel


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 12, generator=g)
    return TensorDataset(x, (x[:, :3].sum(1) > 0).long())


def model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 2))


def training_step(acc, net, optimizer):
    """The step as one function of the batch, for ``acc.capture``."""
    def step(x, y):
        with acc.autocast():
            loss = F.cross_entropy(net(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    return step


def main(out: str, mode: str, global_batch: int, steps: int, resident: bool = True) -> None:
    net, dataset = model(), data()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    device = os.environ.get("GPUACCEL_LOOP_DEVICE", "cpu")
    acc = gpuaccel.Accelerator(device=device, precision="fp32") if mode != "plain" else None
    if acc is None:
        net.to(device)
    world = acc.world_size if acc else 1
    micro = 2 if mode in ("acc-accumulate", "acc-captured") else 1
    loader = DataLoader(dataset, batch_size=global_batch // world // micro, shuffle=False)
    if acc:
        net, optimizer, loader = acc.prepare(net, optimizer, loader, device_resident=resident)  # ACC
    losses, batches, captured = [], iter(loader), False
    if mode == "acc-capture":
        step = acc.capture(training_step(acc, net, optimizer), warmup=2)  # ACC
        for _ in range(steps):
            losses.append(step(*next(batches)).item())
        steps, captured = 0, step.captured
    if mode == "acc-captured":
        passes = (batch for _ in iter(int, 1) for batch in loader)  # (pass after pass: one fetch more than steps)
        get_batch = acc.timed(lambda: next(passes))  # ACC
        x, y = get_batch()
        for _ in range(steps):
            for k in (loop := acc.captured(range(micro), warmup=2)):  # ACC
                if acc.world_size > 1:
                    net.require_backward_grad_sync = k == micro - 1
                with acc.autocast():  # ACC
                    loss = F.cross_entropy(net(x), y) / micro
                x, y = get_batch()
                acc.backward(loss)  # ACC
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item() * micro)
        steps, captured = 0, loop.captured
    for _ in range(steps):
        for k in range(micro):
            x, y = (t.to(device) for t in next(batches))
            # ACC: the first micro-batch of an accumulation (forward and backward) without the all-reduce
            local = acc.no_sync(net) if acc and k < micro - 1 else contextlib.nullcontext()
            with local:
                with (acc.autocast() if acc else contextlib.nullcontext()):  # ACC
                    loss = F.cross_entropy(net(x), y) / micro
                acc.backward(loss) if acc else loss.backward()  # ACC
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() * micro)
    if acc is None or acc.is_main:
        plain = net.module if hasattr(net, "module") else net
        torch.save({"losses": losses, "params": {k: v.detach().clone() for k, v in plain.state_dict().items()},
                    "captured": captured}, out)
    if acc:
        acc.end()  # ACC: the process group goes after what uses it


def fsdp_resume(out: str) -> None:
    """FSDP over the processes: 3 steps, a sharded save, 2 more steps; then the save loaded back
    and the same 2 steps again. Rank 0 writes both end states and the checkpoint's files."""
    acc = gpuaccel.Accelerator(device=os.environ.get("GPUACCEL_LOOP_DEVICE", "cpu"), precision="fp32",
                               strategy="fsdp")
    net = acc.prepare(model())
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    optimizer, loader = acc.prepare(optimizer, DataLoader(data(), batch_size=16))
    batches, ends = list(loader), []

    def train(first: int, last: int) -> None:
        for x, y in batches[first:last]:
            acc.backward(F.cross_entropy(net(x), y))
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()

    train(0, 3)
    acc.save(out + ".ckpt", model=net, optimizer=optimizer, schedule=schedule)
    train(3, 5)
    ends.append(acc._state_of(net))
    acc.load(out + ".ckpt", model=net, optimizer=optimizer, schedule=schedule)
    train(3, 5)
    ends.append(acc._state_of(net))
    if acc.is_main:
        torch.save({"ends": ends, "files": sorted(os.listdir(out + ".ckpt")), "lr": schedule.get_last_lr()}, out)
    acc.end()


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="captured?\\(\\): CUDA graphs need a GPU")
    if sys.argv[2] == "fsdp-resume":
        fsdp_resume(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), "--no-resident" not in sys.argv)
