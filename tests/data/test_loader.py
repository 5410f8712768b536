"""The device loader's logic, run on CPU tensors (the same code runs on the GPU)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpuaccel.data import augment as aug
from gpuaccel.data.augment import AugmentConfig
from gpuaccel.data.loader import READER_NICENESS, PassReader
from gpuaccel.runtime.loaders import PrefetchLoader, ResidentLoader, image_loader

CPU = torch.device("cpu")


def make_loader(n=103, batch=10, train=True, rank=0, world=1, seed=0, augment=None, drop_last=None):
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 4, 4).contiguous()
    return image_loader(images, torch.arange(n), batch_size=batch, device=CPU, mean=[0.0], std=[1 / 255], placement="gpu",
                        train=train, seed=seed, augment=augment, rank=rank, world_size=world, drop_last=drop_last)


def served_labels(loader, epoch=0, start=0):
    return torch.cat([y for _, y in loader.batches(epoch, start)])


def test_each_sample_exactly_once_per_epoch_without_drop():
    loader = make_loader(drop_last=False)
    for epoch in range(3):
        seen = served_labels(loader, epoch)
        assert sorted(seen.tolist()) == list(range(103))


def test_drop_last_keeps_batches_full_and_shuffles_by_epoch():
    loader = make_loader()
    assert len(loader) == 10 and all(x.shape[0] == 10 for x, _ in loader.batches(0))
    assert not torch.equal(served_labels(loader, 0), served_labels(loader, 1))


def test_images_and_labels_stay_paired_and_normalised():
    loader = make_loader()
    for x, y in loader.batches(2):
        # image i holds the value i everywhere; mean 0, std 1/255 makes normalisation the identity
        assert torch.equal(x[:, 0, 0, 0], y.float())


def test_same_seed_same_order_other_seed_other_order():
    assert torch.equal(served_labels(make_loader(seed=3), 1), served_labels(make_loader(seed=3), 1))
    assert not torch.equal(served_labels(make_loader(seed=3), 1), served_labels(make_loader(seed=4), 1))


def test_the_next_epochs_order_drawn_ahead_is_the_order_drawn_then():
    loader = make_loader(seed=3)
    ahead = [served_labels(loader, epoch) for epoch in (0, 1, 2)]  # each epoch draws the next in the background
    assert loader.order._ahead[0][0] == 3
    assert all(torch.equal(a, served_labels(make_loader(seed=3), e)) for e, a in enumerate(ahead))
    loader.order.seed = 4  # (an order drawn for other settings, or another epoch, is not served)
    assert torch.equal(served_labels(loader, 3), served_labels(make_loader(seed=4), 3))
    assert torch.equal(served_labels(loader, 1), served_labels(make_loader(seed=4), 1))


def test_resuming_mid_epoch_serves_the_rest_identically():
    cfg = AugmentConfig(crop_padding=1, flip="random", cutout=2)
    loader = make_loader(augment=cfg)
    full = list(loader.batches(epoch=1))
    rest = list(make_loader(augment=cfg).batches(epoch=1, start=4))
    assert len(rest) == len(full) - 4
    for (xa, ya), (xb, yb) in zip(full[4:], rest):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_are_disjoint_and_cover_the_epoch(world):
    shards = [make_loader(n=101, rank=r, world=world, drop_last=False).order.epoch_indices(5) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # every rank takes the same number of steps
    together = torch.cat(shards).tolist()
    assert set(together) == set(range(101))
    assert len(together) - 101 < world  # only the wrap-around padding repeats
    firsts = [set(s.tolist()) for s in shards]
    overlap = sum(len(a & b) for i, a in enumerate(firsts) for b in firsts[i + 1:])
    assert overlap == len(together) - 101


def test_eval_shards_split_exactly():
    shards = [make_loader(n=101, train=False, rank=r, world=3).order.epoch_indices(0) for r in range(3)]
    assert sorted(torch.cat(shards).tolist()) == list(range(101))


def reference_crop(image: np.ndarray, dy: int, dx: int, pad: int) -> np.ndarray:
    padded = np.pad(image, ((0, 0), (pad, pad), (pad, pad)), mode="reflect")
    return padded[:, dy:dy + image.shape[1], dx:dx + image.shape[2]]


def test_random_crop_matches_a_reflect_pad_reference():
    x = torch.randn(16, 3, 8, 8)
    out = aug.random_crop(x, 2, torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(0)  # the same draws the op made
    dy = torch.randint(0, 5, (16,), generator=gen)
    dx = torch.randint(0, 5, (16,), generator=gen)
    for i in range(16):
        np.testing.assert_allclose(out[i].numpy(), reference_crop(x[i].numpy(), int(dy[i]), int(dx[i]), 2))
    assert len({(int(a), int(b)) for a, b in zip(dy, dx)}) > 1  # offsets really vary


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_one_gather_crops_and_mirrors_the_chosen_images_as_padding_cropping_and_flipping_would(dtype):
    source = torch.randint(0, 256, (20, 3, 6, 7)).to(dtype)
    which = torch.tensor([3, 3, 0, 19, 7, 12])
    dy, dx = torch.tensor([0, 4, 2, 1, 3, 4]), torch.tensor([4, 0, 2, 3, 1, 0])
    mask = torch.tensor([True, False, True, False, False, True])
    out = aug.gather_moved(source, which, aug.AugmentConfig(crop_padding=2), aug.AugmentDraws(crop=(dy, dx)), mask)
    assert out.dtype == dtype and out.shape == (6, 3, 6, 7)
    for i, k in enumerate(which.tolist()):
        expected = reference_crop(source[k].numpy(), int(dy[i]), int(dx[i]), 2)
        np.testing.assert_array_equal(out[i].numpy(), expected[..., ::-1] if mask[i] else expected)
    plain = aug.gather_moved(source, which, aug.AugmentConfig(), aug.AugmentDraws())
    assert torch.equal(plain, source[which])


def test_alternating_flip_flips_each_image_in_exactly_one_of_two_epochs():
    idx = torch.arange(1000)
    gen = torch.Generator()
    even = aug.flip_mask(idx, 4, "alternate", seed=1, generator=gen)
    odd = aug.flip_mask(idx, 5, "alternate", seed=1, generator=gen)
    assert torch.equal(even, ~odd)
    assert 0.4 < even.float().mean() < 0.6
    random = aug.flip_mask(idx, 0, "random", seed=1, generator=gen)
    assert 0.4 < random.float().mean() < 0.6


def test_cutout_zeroes_one_square_of_the_right_size():
    x = torch.ones(50, 1, 16, 16)
    out = aug.cutout(x, 4, torch.Generator().manual_seed(0))
    zeros = (out == 0).sum(dim=(1, 2, 3))
    assert zeros.max() == 16 and zeros.min() >= 4  # squares clipped at the border lose area
    for i in range(50):
        ys, xs = torch.nonzero(out[i, 0] == 0, as_tuple=True)
        assert ys.max() - ys.min() < 4 and xs.max() - xs.min() < 4


def test_augmented_loader_is_deterministic_and_only_in_training():
    cfg = AugmentConfig(crop_padding=1, flip="alternate", cutout=2)
    a = [x for x, _ in make_loader(augment=cfg).batches(0)]
    b = [x for x, _ in make_loader(augment=cfg).batches(0)]
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    ev = make_loader(train=False, augment=cfg)
    x, y = next(ev.batches())
    assert torch.equal(x[:, 0, 0, 0], y.float())  # evaluation is never augmented


def test_channels_last_and_dtype():
    images = torch.randint(0, 255, (8, 3, 4, 4), dtype=torch.uint8)
    loader = image_loader(images, torch.zeros(8, dtype=torch.long), batch_size=4, device=CPU, mean=[0.5] * 3,
                          std=[0.25] * 3, train=False, dtype=torch.bfloat16, channels_last=True)
    x, _ = next(loader.batches())
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last)
    expected = (images[:4].float() / 255 - 0.5) / 0.25
    torch.testing.assert_close(x.float(), expected, atol=0.02, rtol=0.01)
    F.conv2d(x.float(), torch.randn(2, 3, 3, 3))  # a usable input


def make_pair(n=103, batch=10, augment=None, workers=2, **kw):
    """A device loader and a loader of worker processes over the same random RGB images."""
    images = torch.randint(0, 256, (n, 3, 6, 6), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    common = dict(batch_size=batch, device=CPU, mean=[0.4, 0.5, 0.6], std=[0.2, 0.25, 0.3], train=True,
                  augment=augment, **kw)
    return (image_loader(images, torch.arange(n), placement="gpu", **common),
            image_loader(images, torch.arange(n), placement="cpu", workers=workers, **common))


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_loader_serves_the_device_loaders_batches(workers):
    device, host = make_pair(augment=AugmentConfig(crop_padding=2, flip="random"), workers=workers)
    assert len(device) == len(host)
    for epoch in (0, 1):
        pairs = list(zip(device.batches(epoch), host.batches(epoch), strict=True))
        for (xa, ya), (xb, yb) in pairs:
            assert torch.equal(ya, yb)
            torch.testing.assert_close(xa, xb)


def test_both_image_loaders_give_one_float32_sample_for_data_dependent_initialisation():
    device, host = make_pair(augment=AugmentConfig(crop_padding=2, flip="random", cutout=2), workers=0,
                             dtype=torch.bfloat16, channels_last=True)
    (xa, ya), (xb, yb) = device.sample(20), host.sample(20)
    assert xa.dtype == xb.dtype == torch.float32 and xa.shape == (20, 3, 6, 6)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)  # (unaugmented: the same images)
    assert torch.equal(ya, device.sample(20)[1])  # (a fixed sample)


def test_worker_loader_cutout_fills_with_the_mean():
    device, host = make_pair(augment=AugmentConfig(cutout=3), workers=0)
    for (xa, _), (xb, _) in zip(device.batches(0), host.batches(0)):
        holes = xa == 0
        assert holes.any()
        assert xb[holes].abs().max() < 0.03  # the uint8 mean, normalised: zero up to rounding
        torch.testing.assert_close(xa[~holes], xb[~holes])


def test_worker_loader_resumes_mid_epoch_and_shards():
    _, host = make_pair(augment=AugmentConfig(crop_padding=1, flip="alternate"))
    full = list(host.batches(epoch=2))
    rest = list(host.batches(epoch=2, start=3))  # the same persistent workers, a new pass
    for (xa, ya), (xb, yb) in zip(full[3:], rest, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    shards = [make_pair(n=101, rank=r, world_size=2, drop_last=False, workers=0)[1] for r in range(2)]
    labels = [torch.cat([y for _, y in s.batches(4)]) for s in shards]
    assert set(labels[0].tolist()) | set(labels[1].tolist()) == set(range(101))
    assert len(set(labels[0].tolist()) & set(labels[1].tolist())) <= 1  # only the wrap-around pad


def test_size_schedule_serves_each_stage_at_its_size_then_full_size():
    cfg = AugmentConfig(sizes=aug.parse_size_schedule(["3:1.5", "2:0.5"]))
    loader = make_loader(augment=cfg)  # 10 batches of 4x4 images per epoch
    sides = [[x.shape[-1] for x, _ in loader.batches(epoch)] for epoch in range(3)]
    assert sides[0] == [3] * 10 and sides[1] == [3] * 5 + [2] * 5 and sides[2] == [4] * 10
    rest = [x.shape[-1] for x, _ in make_loader(augment=cfg).batches(1, start=7)]
    assert rest == [2] * 3  # a resumed epoch continues the schedule where it was
    for x, y in loader.batches(0):  # each image constant: scaling keeps it so, and paired with its label
        torch.testing.assert_close(x[:, 0, 0, 0], y.float())


def test_size_schedule_parsing_rejects_what_is_not_size_and_epochs():
    assert aug.parse_size_schedule(["24:3", [28, 0.5]]) == ((24, 3.0), (28, 0.5))
    for bad in (["24"], ["x:1"], ["1:1"], ["24:0"], ["24:1:2"]):
        with pytest.raises(ValueError):
            aug.parse_size_schedule(bad)


def test_resize_keeps_dtype_and_layout_and_averages():
    x = torch.rand(2, 3, 8, 8).to(torch.bfloat16).contiguous(memory_format=torch.channels_last)
    y = aug.resize(x, 4)
    assert y.shape == (2, 3, 4, 4) and y.dtype == torch.bfloat16
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y.float().mean(), x.float().mean(), atol=0.02, rtol=0)  # antialiased: an average
    u = torch.full((1, 1, 6, 6), 200, dtype=torch.uint8)
    assert torch.equal(aug.resize(u, (3, 2)), torch.full((1, 1, 3, 2), 200, dtype=torch.uint8))
    assert aug.resize(x, 8) is x and aug.resize(x, None) is x


def test_color_jitter_shifts_then_scales_each_image_within_its_bounds():
    x = torch.zeros(2000, 3, 2, 2) + torch.tensor([1.0, 2.0, 3.0]).view(1, 3, 1, 1)
    generator = torch.Generator().manual_seed(0)
    unit = torch.tensor([10.0, 20.0, 30.0]).view(1, 3, 1, 1)
    y = aug.color_jitter(x, 0.1, 0.2, generator, unit=unit)
    factor = y / (x + 0 * unit)  # each image's value over its original, per channel
    shift = y[:, :, 0, 0]
    assert torch.equal(y, y[:, :, :1, :1].expand_as(y))  # one shift and one factor per image
    low, high = (x[:, :, 0, 0] - 0.1 * unit.view(1, 3)) * 0.8, (x[:, :, 0, 0] + 0.1 * unit.view(1, 3)) * 1.2
    assert ((shift >= low - 1e-5) & (shift <= high + 1e-5)).all()
    assert factor.std() > 0.05 and abs(float(shift.mean(0)[0]) - 1.0) < 0.1  # centred, and varied
    assert aug.color_jitter(x, 0.0, 0.0, generator) is x


def test_worker_loader_jitters_and_resizes_like_the_device_loader():
    mean, std = torch.tensor([0.4, 0.5, 0.6]).view(1, 3, 1, 1), torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    device, host = make_pair(augment=AugmentConfig(crop_padding=1, brightness=0.1, contrast=0.2), workers=0)
    for (xa, ya), (xb, yb) in zip(device.batches(0), host.batches(0), strict=True):
        assert torch.equal(ya, yb)
        pixels = (xa * std + mean) * 255
        unclipped = (pixels > 1) & (pixels < 254)  # the host clips to 0..255 (uint8), the device does not
        assert unclipped.float().mean() > 0.5
        torch.testing.assert_close(xa[unclipped], xb[unclipped], atol=0.03, rtol=0)  # up to uint8 rounding
    device, host = make_pair(augment=AugmentConfig(flip="random", sizes=((4, 1.0),)), workers=0)
    for (xa, _), (xb, _) in zip(device.batches(0), host.batches(0), strict=True):
        assert xa.shape == xb.shape == (10, 3, 4, 4)
        torch.testing.assert_close(xa, xb, atol=0.03, rtol=0)
    assert next(device.batches(1))[0].shape[-1] == 6


class _LoggedKeys(torch.utils.data.Dataset):
    """Item ``key`` is ``key``; each one made is appended to a file, where the test sees what
    the worker processes made and when."""

    def __init__(self, path):
        self.path = path

    def __getitem__(self, key):
        with open(self.path, "a") as log:
            log.write(f"{key}\n")
        return key


def _made(path) -> list[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.parametrize("workers", [0, 2])
def test_pass_reader_reads_on_into_the_next_pass_and_restarts_where_asked(tmp_path, workers):
    log = tmp_path / "made.txt"
    reader = PassReader(_LoggedKeys(log), lambda epoch: [10 * epoch + s for s in range(4)], lambda epoch: epoch + 1,
                        workers=workers, pin_memory=False, prefetch_factor=2)
    assert list(reader.read(0)) == [0, 1, 2, 3]
    if workers:  # the processes go on with pass 1 before it is asked for
        deadline = time.monotonic() + 20
        while not {10, 11} <= set(_made(log)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {10, 11} <= set(_made(log))
    assert list(reader.read(1)) == [10, 11, 12, 13]
    assert _made(log).count(10) == 1  # taken over, not made again

    left = reader.read(2)
    assert [next(left), next(left)] == [20, 21]
    left.close()  # a pass left unfinished: the next one that starts where it stopped goes on
    assert list(reader.read(2, start=2)) == [22, 23]
    assert _made(log).count(22) == 1
    assert list(reader.read(5, start=1)) == [51, 52, 53]  # elsewhere: the processes start there
    assert list(reader.read(1, start=3)) == [13]
    reader.close()
    assert list(reader.read(2)) == [20, 21, 22, 23]


def test_a_pass_reader_without_a_following_pass_stops_after_each(tmp_path):
    log = tmp_path / "made.txt"
    reader = PassReader(_LoggedKeys(log), lambda epoch: [1, 2, 3], lambda epoch: None, workers=2,
                        pin_memory=False, prefetch_factor=2)
    assert list(reader.read(0)) == [1, 2, 3]
    time.sleep(0.5)
    assert sorted(_made(log)) == [1, 2, 3]  # nothing made ahead
    assert list(reader.read(0)) == [1, 2, 3]


class _Niceness(torch.utils.data.Dataset):
    def __getitem__(self, key):
        return os.nice(0)


def test_reader_processes_run_at_a_lower_priority_than_the_training_process():
    reader = PassReader(_Niceness(), lambda epoch: [0, 1], lambda epoch: None, workers=2, pin_memory=False,
                        prefetch_factor=2)
    expected = min(os.nice(0) + READER_NICENESS, 19)
    assert list(reader.read(0)) == [expected, expected]
    reader.close()


def test_image_loader_keeps_cpu_data_in_process_unless_told():
    images, labels = torch.zeros(8, 1, 2, 2, dtype=torch.uint8), torch.zeros(8, dtype=torch.long)
    common = dict(device=CPU, batch_size=4, mean=[0.0], std=[1.0], train=False)
    assert isinstance(image_loader(images, labels, **common), ResidentLoader)
    assert isinstance(image_loader(images, labels, placement="cpu", workers=0, **common), PrefetchLoader)


@pytest.mark.parametrize("start", [0, 5])
def test_batches_prepared_together_are_the_batches_prepared_one_at_a_time(start):
    augment = AugmentConfig(crop_padding=2, flip="random", cutout=2, brightness=0.2, contrast=0.2)
    together, alone = (make_pair(augment=augment, drop_last=False)[0] for _ in range(2))  # 103 images: a last batch of 3
    assert alone.gather.together == 1 and len(alone) == 11  # (on a CPU: one at a time)
    together.gather.together = 4  # (as on a GPU)
    pairs = list(zip(together.batches(3, start), alone.batches(3, start), strict=True))
    assert len(pairs) == 11 - start and len(pairs[-1][0][1]) == 3
    for (xa, ya), (xb, yb) in pairs:
        assert torch.equal(ya, yb) and torch.equal(xa, xb)
    assert not torch.equal(pairs[0][0][0], next(alone.batches(4, start))[0])  # (another epoch draws anew)
