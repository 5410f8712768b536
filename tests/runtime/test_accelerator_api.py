"""gpuaccel.Accelerator as a drop-in for a script's own loop: what a prepared object keeps of
the original, the settings' spellings, state files with plain values, compiling before or after
prepare, residency that keeps a seeded script's random stream, and timing a script's own batches."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

import gpuaccel
from gpuaccel import GpuaccelError
from gpuaccel.device import precision_name
from gpuaccel.runtime import PrefetchLoader, ResidentLoader


class Squares(Dataset):
    """A map-style data set that is not a TensorDataset: items computed in ``__getitem__``."""

    def __init__(self, n: int = 96, jitter: bool = False):
        self.n, self.jitter = n, jitter

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x = torch.full((6,), float(i % 7)) + torch.arange(6.0)
        if self.jitter:  # a random augmentation: items differ from one read to the next
            x = x + torch.randn(6)
        return x, torch.tensor(i % 3)


def _net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("resident", [None, True, False])
def test_prepared_loaders_keep_the_dataloaders_attributes(resident):
    dataset = Squares()
    loader = DataLoader(dataset, batch_size=10, shuffle=True)
    prepared = gpuaccel.Accelerator(device="cpu", monitor=False).prepare(loader, device_resident=resident)
    assert isinstance(prepared, PrefetchLoader if resident is False else ResidentLoader)
    assert prepared.dataset is dataset and prepared.batch_size == 10 and isinstance(prepared.sampler, RandomSampler)
    assert len(prepared) == len(loader) == 10 and prepared.drop_last is False and prepared.num_workers == 0
    assert len(prepared.dataset) == 96  # what scripts print: len(train_loader.dataset)
    sizes = [len(y) for _, y in prepared]
    assert sizes == [10] * 9 + [6]


def test_random_augmentation_inside_the_data_set_keeps_it_read_per_step_and_draws_nothing_of_the_scripts():
    loader = DataLoader(Squares(jitter=True), batch_size=8, shuffle=True)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    prepared = gpuaccel.Accelerator(device="cpu", monitor=False).prepare(loader)
    assert isinstance(prepared, PrefetchLoader)  # items change between reads: not gathered
    assert torch.equal(torch.get_rng_state(), state)  # the reads that found it out drew nothing
    with pytest.raises(GpuaccelError, match="change from one read to the next"):
        gpuaccel.Accelerator(device="cpu", monitor=False).prepare(loader, device_resident=True)


def _seeded_losses(prepare: bool, resident=None, epochs: int = 2) -> list[float]:
    """A seeded script: shuffled batches (the global generator), dropout (the global generator)
    and Python's own random module."""
    torch.manual_seed(123)
    random.seed(5)
    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(Squares(), batch_size=16, shuffle=True)
    if prepare:
        acc = gpuaccel.Accelerator(device="cpu", monitor=False)
        net, optimizer, loader = acc.prepare(net, optimizer, loader, device_resident=resident)
    losses = []
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(net(x), y) + 0.0 * random.random()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return losses


@pytest.mark.parametrize("resident", [None, True, False])
def test_a_seeded_script_gives_the_same_losses_with_and_without_prepare(resident):
    """Residency follows the DataLoader's own sampler and draws the random numbers its iterator
    would, so the batches and everything drawn after them (dropout) stay the script's."""
    assert _seeded_losses(prepare=True, resident=resident) == _seeded_losses(prepare=False)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16", "bf16-mixed", torch.bfloat16])
def test_precision_takes_its_common_spellings(spelling):
    assert gpuaccel.Accelerator(device="cpu", precision=spelling, monitor=False).precision.name == "bf16"


def test_every_precision_spelling_names_one_precision():
    for spellings, name in (((torch.float16, "half", "float16", "16-mixed", "fp16"), "fp16"),
                            ((torch.float32, "32", "float32", "fp32", "32-true"), "fp32"),
                            (("tf32", "TF32", "tensorfloat32"), "tf32"),
                            ((None, "auto"), "auto")):
        assert {precision_name(s) for s in spellings} == {name}
    with pytest.raises(GpuaccelError, match="unknown precision 'int8'"):
        precision_name("int8")


def test_python_errors_name_python_arguments():
    with pytest.raises(GpuaccelError) as caught:
        gpuaccel.Accelerator(device="cpu", precision="fp16")
    assert "precision fp16 needs a CUDA GPU" in str(caught.value) and "--" not in str(caught.value)
    with pytest.raises(GpuaccelError, match="precision tf32 needs an NVIDIA GPU of compute capability 8.0"):
        gpuaccel.Accelerator(device="cpu", precision="tf32")
    with pytest.raises(GpuaccelError, match="batch_size must be a whole number"):
        gpuaccel.TrainConfig(batch_size=0).validate()


def test_save_and_load_take_plain_values_beside_objects(tmp_path):
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    net = acc.prepare(_net())
    optimizer = acc.prepare(torch.optim.AdamW(net.parameters(), lr=1e-3))
    acc.save(tmp_path / "state.pt", model=net, optimizer=optimizer, step=5, best=0.91, history=[1.5, 1.25],
             note="warm start")
    again = acc.prepare(_net())
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    state = acc.load(tmp_path / "state.pt", model=again)
    assert state["step"] == 5 and state["best"] == 0.91 and state["history"] == [1.5, 1.25]
    assert state["note"] == "warm start"
    for a, b in zip(net.parameters(), again.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(GpuaccelError, match="read plain values from what load"):
        acc.load(tmp_path / "state.pt", step=0)


def test_both_doors_write_one_file_format_and_read_each_others(tmp_path):
    """acc.save writes the form of a Trainer's checkpoint (header, named states, the random
    number generators): the Trainer's reader takes it; acc.load takes a Trainer run's
    checkpoint.pt into a model and optimizer; a file acc.save wrote before the header still loads;
    a draw after load repeats the draw after save (exact resume of a user's loop)."""
    from gpuaccel.train import checkpoint

    torch.manual_seed(3)
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    net = acc.prepare(_net())
    optimizer = acc.prepare(torch.optim.AdamW(net.parameters(), lr=1e-3))
    acc.save(tmp_path / "state.pt", model=net, optimizer=optimizer, step=5)
    after_save = torch.rand(3)
    state = checkpoint.load(tmp_path / "state.pt")
    assert state["format"] == checkpoint.FORMAT and state["step"] == 5 and "_rng" in state
    torch.rand(7)  # (the stream moves on)
    acc.load(tmp_path / "state.pt", model=net)
    assert torch.equal(torch.rand(3), after_save)
    with pytest.raises(GpuaccelError, match="_rng is a name the file keeps for itself"):
        acc.save(tmp_path / "bad.pt", _rng=1)

    legacy = {"model": {k: v.clone() for k, v in net.state_dict().items()}, "_scaler": acc.scaler.state_dict()}
    torch.save(legacy, tmp_path / "legacy.pt")
    acc.load(tmp_path / "legacy.pt", model=net)

    x, y = torch.randn(64, 6), torch.randint(0, 3, (64,))
    config = gpuaccel.TrainConfig(epochs=1, batch_size=32, device="cpu", monitor=False, val_split=0.25,
                                  run_dir=str(tmp_path / "run"))
    gpuaccel.Trainer(config, model=_net(), train_data=(x, y), task="classification", quiet=True).fit()
    fresh = acc.prepare(_net())
    held = acc.load(tmp_path / "run" / "checkpoint.pt", model=fresh)
    trained = checkpoint.load(tmp_path / "run" / "checkpoint.pt")["model"]
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, trained[key])
    assert held["optimizer"]["state"] and held["position"]["global_step"] >= 1  # (for an optimizer of its groups)


@pytest.mark.parametrize("order", ["compile-then-prepare", "prepare-then-compile"])
def test_compiling_before_or_after_prepare_trains_and_saves_plain_keys(tmp_path, order):
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    net = _net()
    if order == "compile-then-prepare":
        net = acc.prepare(torch.compile(net, backend="eager"))
    else:
        net = torch.compile(acc.prepare(net), backend="eager")
    assert hasattr(net, "_orig_mod")
    optimizer = acc.prepare(torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    with acc.no_sync(net):  # (found through the compiled wrapper)
        acc.backward(F.cross_entropy(net(x), y))
    optimizer.step()
    acc.save(tmp_path / "m.pt", model=net)
    keys = torch.load(tmp_path / "m.pt", weights_only=True)["model"].keys()
    assert keys == _net().state_dict().keys()  # no '_orig_mod.' prefixes


def test_schedulers_take_an_optimizer_prepared_for_loss_scaling():
    from gpuaccel.runtime.placement import ScaledOptimizer

    net = _net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaled = ScaledOptimizer(optimizer, scaler)
    schedule = torch.optim.lr_scheduler.StepLR(scaled, step_size=1, gamma=0.5)
    scaler.scale(F.cross_entropy(net(torch.randn(4, 6)), torch.tensor([0, 1, 2, 0]))).backward()
    scaled.step()
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_timed_counts_a_scripts_own_batch_function_in_the_data_wait():
    import time

    acc = gpuaccel.Accelerator(device="cpu", monitor=False)

    def get_batch(split):
        time.sleep(0.02)
        return torch.randn(4, 6)

    get_batch = acc.timed(get_batch)
    for _ in range(5):
        get_batch("train")
        time.sleep(0.005)
    stats = acc.stats()
    assert get_batch.__name__ == "get_batch" and 0.5 < stats["data_wait_share"] <= 1.0


class SlowPasses:
    """A script's own batch source: each pass three batches, each made in 20 ms."""

    def __init__(self):
        self.asked = []

    def __len__(self):
        return 3

    def batches(self, epoch=0, start=0):
        import time

        self.asked.append((epoch, start))
        for step in range(start, 3):
            time.sleep(0.02)
            yield torch.full((4, 6), float(10 * epoch + step)), torch.zeros(4, dtype=torch.long)


def test_a_prepared_batch_source_iterates_pass_after_pass_with_its_waits_timed():
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    source = SlowPasses()
    loader = acc.prepare(source)
    assert len(loader) == 3
    firsts = [[float(x[0, 0]) for x, _ in loader] for _ in range(2)]
    assert firsts == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]] and source.asked == [(0, 0), (1, 0)]
    assert acc.stats()["data_wait_share"] > 0.5  # (nothing else happened between the batches)
    with pytest.raises(GpuaccelError, match="prepare\\(\\) takes models, optimizers, DataLoaders, batch sources"):
        acc.prepare(object())


def test_capture_as_a_decorator_runs_the_step_uncaptured_off_a_gpu():
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    net = acc.prepare(_net())
    optimizer = acc.prepare(torch.optim.SGD(net.parameters(), lr=0.1))

    with pytest.warns(UserWarning, match="CUDA graphs need a GPU"):
        @acc.capture(warmup=2)
        def step(x, y):
            loss = F.cross_entropy(net(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

    assert step.__name__ == "step" and not step.captured
    assert step(torch.randn(4, 6), torch.tensor([0, 1, 2, 0])).dim() == 0


def test_a_captured_step_the_script_no_longer_holds_is_freed(monkeypatch):
    """A step defined inside the function that runs an epoch is captured anew each epoch; the
    accelerator must not keep the old ones (on a GPU: their graphs and memory pools) alive."""
    monkeypatch.setattr(gpuaccel.Accelerator, "_capture_obstacle", lambda self: None)  # (as on a GPU)
    acc = gpuaccel.Accelerator(device="cpu", monitor=False)
    net = acc.prepare(_net())
    steps = []

    def epoch():
        @acc.capture
        def step(x):
            return net(x).sum()
        step(torch.randn(2, 6))
        steps.append(weakref.ref(step))

    for _ in range(3):
        epoch()
    gc.collect()
    assert len(steps) == 3 and all(ref() is None for ref in steps)


def test_a_tensor_dataset_is_resident_and_served_in_its_samplers_order():
    x = torch.arange(20.0).unsqueeze(1)
    loader = DataLoader(TensorDataset(x, torch.arange(20)), batch_size=6, shuffle=False, drop_last=True)
    prepared = gpuaccel.Accelerator(device="cpu", monitor=False).prepare(loader)
    assert isinstance(prepared, ResidentLoader)
    assert [y.tolist() for _, y in prepared] == [list(range(0, 6)), list(range(6, 12)), list(range(12, 18))]


def test_automatic_precision_keeps_recurrent_models_in_fp32():
    """cuDNN's recurrent kernels repack cast weights every step under autocast: 'auto' picks fp32
    for them; an explicit precision stands."""
    from gpuaccel.device import Precision

    acc = gpuaccel.Accelerator(device="cpu", precision="bf16", monitor=False)
    acc._precision_chosen = True  # (as 'auto' resolves to bf16 on a GPU)
    acc.prepare(nn.LSTM(4, 8))
    assert acc.precision == Precision("fp32", None, False) and not acc.scaler.is_enabled()
    explicit = gpuaccel.Accelerator(device="cpu", precision="bf16", monitor=False)
    explicit.prepare(nn.GRU(4, 8))
    assert explicit.precision.name == "bf16"


@pytest.fixture
def tf32_gpu(monkeypatch):
    """As on a GPU of compute capability 8.0 on, with cuBLAS's TF32 off (a process-wide flag, put
    back after)."""
    import gpuaccel.device
    import gpuaccel.runtime.placement

    for module in (gpuaccel.device, gpuaccel.runtime.placement):
        monkeypatch.setattr(module, "has_tf32", lambda device: True)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def test_automatic_precision_gives_recurrent_models_tf32_matmuls_where_the_gpu_has_them(tf32_gpu):
    """Off autocast, the layers around a recurrent one (an LSTM language model's decoder) still take
    the tensor cores, as cuDNN's recurrent kernels do by default: 'auto' picks tf32 and turns on
    cuBLAS's TF32 for the process."""
    acc = gpuaccel.Accelerator(device="cpu", precision="bf16", monitor=False)
    acc._precision_chosen = True
    acc.prepare(nn.LSTM(4, 8))
    assert acc.precision.name == "tf32" and acc.precision.autocast_dtype is None
    assert not acc.scaler.is_enabled() and torch.backends.cuda.matmul.allow_tf32


def test_a_recordings_copies_keep_the_strides_of_its_arguments():
    """A compiled model guards on strides: the copies a captured step records with (and warms up
    on) must be laid out like the batches it replays, or the model compiles again inside the
    recording (language-model windows are views with a row stride one longer than their width)."""
    from gpuaccel.runtime.capture import _Recording

    windows = torch.arange(4 * 9).view(4, 9)
    inputs, targets = windows[:, :-1], windows[:, 1:]
    images = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
    recording = _Recording()
    recording.keep(([(inputs, targets)], images, torch.ones(1).expand(5), 3))
    [(kept_inputs, kept_targets)], kept_images, kept_expanded, plain = recording.args
    assert kept_inputs.stride() == inputs.stride() == (9, 1) and torch.equal(kept_inputs, inputs)
    assert kept_targets.stride() == targets.stride() and kept_images.stride() == images.stride()
    assert kept_inputs.data_ptr() != inputs.data_ptr() and torch.equal(kept_expanded, torch.ones(5)) and plain == 3
    recording.copy_in(([(inputs + 1, targets)], images, torch.ones(5), 3))
    assert torch.equal(kept_inputs, inputs + 1)


def test_trainer_gives_a_recurrent_model_the_accelerators_precision_and_batches_to_match(tmp_path, monkeypatch,
                                                                                           tf32_gpu):
    """Trainer asks the accelerator as prepare() does: under 'auto' (bf16 on a GPU) a user's LSTM
    trains in tf32, with fp32 batches (bf16 ones would not reach its fp32 weights), and the summary
    says so."""
    import gpuaccel.runtime.placement as placement

    real = placement.resolve_precision
    monkeypatch.setattr(placement, "resolve_precision",  # (auto as on a GPU: bf16)
                        lambda spec, device: real("bf16" if precision_name(spec) == "auto" else spec, device))

    class Recurrent(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = nn.LSTM(4, 16, batch_first=True), nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    torch.manual_seed(0)
    x = torch.randn(256, 8, 4)
    y = (x[:, :, 0].sum(1) > 0).long()
    config = gpuaccel.TrainConfig(batch_size=32, epochs=1, lr=0.05, device="cpu", monitor=False,
                                  run_dir=str(tmp_path / "run"))
    trainer = gpuaccel.Trainer(config, model=Recurrent(), train_data=(x, y), eval_data=(x[:64], y[:64]),
                               task="classification", quiet=True)
    summary = trainer.fit()
    assert trainer.precision.name == "tf32" and summary["precision"] == "tf32" and not trainer.scaler.is_enabled()
    assert summary["steps"] == 8


def test_a_loss_pytorch_refuses_under_autocast_is_one_line_saying_what_to_use():
    """PyTorch refuses F.binary_cross_entropy under CUDA autocast; the accelerator's autocast turns that
    refusal into one line naming the loss and the way out (here raised by hand, as on a GPU)."""
    acc = gpuaccel.Accelerator(device="cpu", precision="bf16")
    with pytest.raises(GpuaccelError, match="F.binary_cross_entropy .* F.binary_cross_entropy_with_logits"):
        with acc.autocast():
            raise RuntimeError("torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to "
                               "autocast.")
    with pytest.raises(RuntimeError, match="something else"):  # other errors pass as they are
        with acc.autocast():
            raise RuntimeError("something else")
    with acc.autocast():
        assert torch.is_autocast_cpu_enabled()
        y = nn.Linear(4, 2)(torch.randn(3, 4))
    assert y.dtype == torch.bfloat16


def test_a_prepared_loader_says_whether_its_data_set_is_on_the_device():
    acc = gpuaccel.Accelerator(device="cpu")
    data = TensorDataset(torch.randn(64, 3), torch.randint(0, 2, (64,)))
    resident = acc.prepare(DataLoader(data, batch_size=8))
    streamed = acc.prepare(DataLoader(data, batch_size=8), device_resident=False)
    assert resident.resident is True and streamed.resident is False


@pytest.mark.gpu
def test_pinned_copies_reuse_one_buffer_per_tensor_and_let_go_of_those_not_copied():
    from gpuaccel.device import PinnedCopies

    device = torch.device("cuda")
    weight, other = torch.randn(64, 32, device=device), torch.randn(8, device=device)
    copies = PinnedCopies(device)
    first = copies(weight)
    assert copies(weight) is first  # a tensor named twice (tied weights) is copied once
    copies(other)
    copies.finish()
    assert first.is_pinned() and torch.equal(first, weight.cpu())
    weight.add_(1)
    assert copies(weight) is first  # refilled, not made again
    copies.finish()
    assert torch.equal(first, weight.cpu())
    assert len(copies._buffers) == 1  # the buffer of the tensor not copied since went
