"""gpuaccel.Accelerator on a user's own loop: the same training as the plain loop, on one or
two processes, and a save/load round trip."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import gpuaccel
from gpuaccel import GpuaccelError

TESTS = Path(__file__).resolve().parents[1]  # (the helpers beside conftest.py)
sys.path.insert(0, str(TESTS))
import accelerator_loop  # noqa: E402
from launch import run_processes  # noqa: E402


def _result(path):
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("resident", [True, False])
def test_the_same_loop_gives_the_same_losses_with_and_without_the_accelerator(tmp_path, resident):
    accelerator_loop.main(str(tmp_path / "plain.pt"), "plain", 32, 6)
    accelerator_loop.main(str(tmp_path / "acc.pt"), "acc", 32, 6, resident=resident)
    plain, acc = _result(tmp_path / "plain.pt"), _result(tmp_path / "acc.pt")
    assert max(abs(a - b) for a, b in zip(plain["losses"], acc["losses"])) < 1e-6
    for key, value in plain["params"].items():
        torch.testing.assert_close(acc["params"][key], value, atol=1e-6, rtol=0)


class _WordModel(nn.Module):
    """pytorch/examples' word language model in small: embedding, 2-layer LSTM, decoder."""

    def __init__(self, vocab: int = 50, width: int = 16):
        super().__init__()
        self.encoder, self.decoder = nn.Embedding(vocab, width), nn.Linear(width, vocab)
        self.rnn = nn.LSTM(width, width, 2)

    def forward(self, tokens):
        return torch.log_softmax(self.decoder(self.rnn(self.encoder(tokens))[0]), -1)


def test_a_plain_port_runs_the_same_operations_a_step_as_the_loop_it_ports():
    """``prepare``, ``autocast`` and ``backward`` add no operation to a one-device step (a plain
    port's speed rests on it: benchmarks/porting): the profiler records the same operators, in
    the same order, for the script's step and for its port."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model, tokens = _WordModel(), torch.randint(50, (2, 7, 4))

    def step(net, autocast, backward):
        net.zero_grad()
        with autocast():
            output = net(tokens[0])
        loss = nn.functional.nll_loss(output.view(-1, 50), tokens[1].view(-1))
        backward(loss)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.25)
        for p in net.parameters():
            p.data.add_(p.grad, alpha=-20.0)
        return loss.item()

    def operators(run) -> list[str]:
        run()  # (first calls: the allocator's and the LSTM's set-up)
        with profile(activities=[ProfilerActivity.CPU]) as recorded:
            run()
        return [event.name for event in recorded.events()]

    plain = operators(lambda: step(model, contextlib.nullcontext, torch.Tensor.backward))
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    ported = acc.prepare(model)
    port = operators(lambda: step(ported, acc.autocast, acc.backward))
    assert len(plain) > 50 and "aten::lstm" in plain, plain[:20]
    assert port == plain


def _two_processes(out, mode="fsdp-resume", *args):
    run_processes(out, mode, *args, program=(str(TESTS / "accelerator_loop.py"),), timeout=120)


@pytest.mark.parametrize("mode", ["acc", "acc-accumulate", "acc-capture", "acc-captured"])
def test_two_processes_with_half_the_batch_train_like_one_with_all_of_it(tmp_path, mode):
    """On two GPUs (GPUACCEL_LOOP_DEVICE=cuda) the captured modes record the gradient all-reduce
    inside their graphs; on the CPU they run uncaptured."""
    accelerator_loop.main(str(tmp_path / "one.pt"), "plain", 32, 5)
    _two_processes(str(tmp_path / "two.pt"), mode, "32", "5")
    one, two = _result(tmp_path / "one.pt"), _result(tmp_path / "two.pt")
    on_gpus = os.environ.get("GPUACCEL_LOOP_DEVICE", "cpu").startswith("cuda")
    assert two["captured"] == (on_gpus and mode in ("acc-capture", "acc-captured"))
    for key, value in one["params"].items():
        torch.testing.assert_close(two["params"][key], value, atol=2e-6, rtol=0)


def test_a_sharded_save_is_written_by_every_process_and_resumes_to_identical_weights(tmp_path):
    _two_processes(str(tmp_path / "fsdp.pt"))
    result = _result(tmp_path / "fsdp.pt")
    after, again = result["ends"]
    for key, value in after.items():
        assert torch.equal(again[key], value), key
    # torch.distributed.checkpoint's layout: its metadata and one shard file per process
    assert ".metadata" in result["files"] and "extra.pt" in result["files"]
    assert sum(name.endswith(".distcp") for name in result["files"]) == 2
    assert result["lr"] == [pytest.approx(1e-2 * 0.5 ** 2)]  # the schedule came back too
    assert not (tmp_path / "fsdp.pt.ckpt.partial").exists()


def test_save_and_load_resume_to_identical_weights(tmp_path):
    def setup():
        net = accelerator_loop.model()
        return acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))

    def train(net, optimizer, steps, start):
        x, y = accelerator_loop.data().tensors
        for i in range(start, start + steps):
            loss = nn.functional.cross_entropy(net(x[i * 16:(i + 1) * 16]), y[i * 16:(i + 1) * 16])
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

    acc = gpuaccel.Accelerator(device="cpu")
    net, optimizer = setup()
    train(net, optimizer, 3, 0)
    acc.save(tmp_path / "state.pt", model=net, optimizer=optimizer)
    train(net, optimizer, 3, 3)
    resumed, resumed_optimizer = setup()
    acc.load(tmp_path / "state.pt", model=resumed, optimizer=resumed_optimizer)
    train(resumed, resumed_optimizer, 3, 3)
    for a, b in zip(net.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(GpuaccelError, match="holds no state for scheduler"):
        acc.load(tmp_path / "state.pt", scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))


def test_prepare_refuses_what_it_cannot_prepare():
    with pytest.raises(GpuaccelError, match="not str"):
        gpuaccel.Accelerator(device="cpu").prepare("model")


@pytest.mark.parametrize("resident", [True, False])
def test_image_batches_come_in_the_prepared_models_layout(resident):
    acc = gpuaccel.Accelerator(device="cpu", channels_last=True)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    images = torch.utils.data.TensorDataset(torch.rand(16, 3, 8, 8), torch.arange(16))
    model, loader = acc.prepare(model, torch.utils.data.DataLoader(images, batch_size=4), device_resident=resident)
    x, y = next(iter(loader))
    assert x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() and y.dim() == 1
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


def _captured_training(device: str, capture: bool, step_fn=None, strict: bool = False):
    """AdamW with a decaying rate over 8 batches; the step captured or not. Returns the
    losses, the final weights and the step."""
    from torch.utils.data import DataLoader

    net = accelerator_loop.model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    acc = gpuaccel.Accelerator(device=device, precision="fp32")
    loader = DataLoader(accelerator_loop.data(), batch_size=32, drop_last=True)
    net, optimizer, loader = acc.prepare(net, optimizer, loader)
    step = (step_fn or accelerator_loop.training_step)(acc, net, optimizer)
    step = acc.capture(step, strict=strict) if capture else step
    losses = []
    for x, y in loader:
        losses.append(step(x, y).item())
        schedule.step()
    return losses, {k: v.detach().cpu() for k, v in net.state_dict().items()}, step


def test_capture_on_the_cpu_runs_the_step_uncaptured_with_one_notice():
    plain_losses, plain_params, _ = _captured_training("cpu", capture=False)
    with pytest.warns(UserWarning, match="CUDA graphs need a GPU: the step runs uncaptured"):
        losses, params, _ = _captured_training("cpu", capture=True)
    assert losses == plain_losses
    for key, value in plain_params.items():
        assert torch.equal(params[key], value)
    with pytest.raises(GpuaccelError, match="CUDA graphs need a GPU; FSDP gathers and frees"):
        gpuaccel.Accelerator(device="cpu", strategy="fsdp").capture(lambda: None, strict=True)
    with pytest.warns(UserWarning, match="mode reduce-overhead records CUDA graphs of its own.*the step runs uncaptured"):
        step = gpuaccel.Accelerator(device="cpu", compile=True, compile_mode="reduce-overhead").capture(lambda: 7)
    assert step() == 7 and not step.captured


@pytest.mark.gpu
def test_a_captured_step_trains_like_the_uncaptured_one_and_reads_the_schedules_rate():
    plain_losses, plain_params, _ = _captured_training("cuda", capture=False)
    losses, params, step = _captured_training("cuda", capture=True)
    assert step.captured and len(losses) == 8  # 3 warm-up steps, a recorded one, 4 replays
    assert max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-5
    for key, value in plain_params.items():
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=1e-5)
    x, y = accelerator_loop.data().tensors
    assert step(x[:16].cuda(), y[:16].cuda()).dim() == 0  # another shape: warmed up (and later recorded) apart
    assert len(step.recordings) == 2

    def syncing(acc, net, optimizer):
        def step(x, y):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            if loss.item() > 100:  # a host sync: cannot be recorded
                loss = loss / 2
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()
        return step

    with pytest.warns(UserWarning, match="cannot be captured as one CUDA graph: something in it waits for the GPU"):
        losses, _, step = _captured_training("cuda", capture=True, step_fn=syncing)
    assert not step.captured and max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-5  # it ran eagerly
    with pytest.raises(GpuaccelError, match="cannot be captured as one CUDA graph"):
        _captured_training("cuda", capture=True, step_fn=syncing, strict=True)
    # the failed capture leaves the generator usable: random draws and another capture still work
    torch.randn(4, device="cuda")
    losses, _, step = _captured_training("cuda", capture=True)
    assert step.captured and max(abs(a - b) for a, b in zip(losses, plain_losses)) < 1e-5


@pytest.mark.gpu
def test_an_optimizer_that_prepare_did_not_see_is_named_when_capture_fails():
    net = accelerator_loop.model().cuda()
    optimizer = torch.optim.Adadelta(net.parameters(), lr=1.0)  # not capturable, and not prepared
    acc = gpuaccel.Accelerator(device="cuda", precision="fp32")
    net = acc.prepare(net)
    x, y = (t.cuda() for t in accelerator_loop.data().tensors)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    with pytest.raises(GpuaccelError, match="Adadelta was not capturable"):
        captured = acc.capture(step, strict=True)
        for _ in range(5):
            captured(x[:32], y[:32])
    # prepared, it is made capturable and the step records
    prepared = acc.prepare(torch.optim.Adadelta(net.parameters(), lr=1.0))
    assert prepared.param_groups[0]["capturable"]


@pytest.mark.gpu
def test_micro_batches_accumulated_inside_one_captured_step_train_like_the_eager_loop():
    def run(capture: bool):
        net = accelerator_loop.model()
        acc = gpuaccel.Accelerator(device="cuda", precision="fp32")
        net, optimizer = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))

        def step(x, y):
            for xs, ys in zip(x.chunk(4), y.chunk(4)):  # four micro-batches, one optimizer step
                acc.backward(torch.nn.functional.cross_entropy(net(xs), ys) / 4)
            optimizer.step()
            optimizer.zero_grad()
        step = acc.capture(step, strict=True) if capture else step
        x, y = (t.cuda() for t in accelerator_loop.data().tensors)
        for i in range(8):
            step(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
        return [p.detach().cpu() for p in net.parameters()], step

    eager, _ = run(False)
    captured, step = run(True)
    assert step.captured
    for a, b in zip(eager, captured):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class _SlowDataset(torch.utils.data.Dataset):
    """Items that take 20 ms each to read."""

    def __len__(self):
        return 16

    def __getitem__(self, i):
        import time

        time.sleep(0.02)
        return torch.full((4,), float(i)), i % 2


def test_stats_report_the_share_of_time_spent_waiting_for_batches():
    from torch.utils.data import DataLoader, TensorDataset

    acc = gpuaccel.Accelerator(device="cpu")
    slow = acc.prepare(DataLoader(_SlowDataset(), batch_size=4), device_resident=False)
    for x, y in slow:
        x.sum()  # next to no work: nearly all the time is spent waiting for the next batch
    waiting = acc.stats()
    assert waiting["data_wait_share"] > 0.8 and waiting["seconds"] > 0.2, waiting
    assert waiting["gpu_util"] is None and waiting["gpu_monitor"] == "no GPU in use"
    resident = acc.prepare(DataLoader(TensorDataset(torch.randn(64, 1024)), batch_size=16))
    weight = torch.randn(1024, 1024) / 32
    for (x,) in resident:
        for _ in range(100):  # (20 left the fetch of the next batch at up to 21% of a busy 2-core machine's time)
            x = torch.tanh(x @ weight)  # the time is the step's: the batch is already there
    assert acc.stats()["data_wait_share"] < 0.2
    assert acc.stats() == {"seconds": 0.0, "data_wait_share": 0.0, "gpu_util": None, "gpu_mem_used_mib": None,
                           "gpu_power_w": None, "gpu_monitor": "no GPU in use"}  # nothing since the last call


@pytest.mark.gpu
def test_a_flat_captured_loop_holding_its_loss_warns_nothing_and_times_its_batches():
    """nanoGPT's shape of loop: a module-level ``get_batch`` through ``acc.timed``, a captured step
    that returns its loss with the autograd graph, held by the loop into the next call. No
    PyTorch warning about the gradient-accumulation nodes' streams, and ``stats()`` counts the
    loop's time from its timed batches."""
    import warnings

    data, targets = (t.cuda() for t in accelerator_loop.data().tensors)
    acc = gpuaccel.Accelerator(device="cuda", precision="bf16")
    model = accelerator_loop.model()
    net, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))

    def get_batch(split):
        rows = torch.randint(len(data), (32,), device="cuda")
        return data[rows], targets[rows]

    get_batch = acc.timed(get_batch)

    @acc.capture
    def step(x, y):
        with acc.autocast():
            loss = torch.nn.functional.cross_entropy(net(x), y)
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss  # (with its graph, as a script returns it)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = get_batch("train")
        for _ in range(12):
            loss = step(x, y)
            x, y = get_batch("train")
        assert torch.isfinite(loss).item()
        stats = acc.stats()
    assert step.captured
    assert not [w for w in caught if "AccumulateGrad" in str(w.message)], [str(w.message) for w in caught]
    assert stats["seconds"] > 0 and 0 <= stats["data_wait_share"] < 1, stats
    acc.end()
