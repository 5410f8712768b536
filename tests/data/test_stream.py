"""The streaming JPEG loader on the CPU: crop geometry and resampling against reference
implementations, shard ownership and order, bad files inside shards, and training from
files through the CLI (the same code runs on the GPU, with nvJPEG doing the decoding)."""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CLASSES, assert_user_error, make_image_folder, run
from PIL import Image

from gpuaccel.data import open_dataset
from gpuaccel.data import crops, nvjpeg
from gpuaccel.data.crops import ImageTable, centre_boxes, random_resized_boxes, resample_boxes
from gpuaccel.data.stream import PILLOW_READERS, ShardOrder, StreamingDataset, default_cpu_decode
from gpuaccel.errors import GpuaccelError
from gpuaccel.runtime.loaders import PrefetchLoader, stream_loader

CPU = torch.device("cpu")


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth colour field plus noise: every pixel differs, edges matter."""
    rng = np.random.default_rng(seed)
    base = Image.fromarray(rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8))
    array = np.asarray(base.resize((w, h), Image.Resampling.BICUBIC), dtype=np.float64)
    return np.clip(array + rng.normal(0, 12, array.shape), 0, 255).astype(np.uint8)


def chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


# One process runs the kernel through Triton's interpreter for the whole module (each call in a new
# one paid seconds of imports): a line "INPUTS OUTPUT" in, the result saved to OUTPUT, a line out.
_INTERPRETED_KERNEL = """
import sys, traceback, torch
from gpuaccel.data import crops
for line in sys.stdin:
    inputs, output = line.split()
    try:
        args, form = torch.load(inputs, weights_only=False)
        torch.save(crops.resample_boxes(*args, method="kernel", **form), output)
        print("ok", flush=True)
    except Exception:
        print(repr(traceback.format_exc()), flush=True)
"""


@pytest.fixture(scope="module")
def interpreter():
    process = subprocess.Popen([sys.executable, "-c", _INTERPRETED_KERNEL], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
    yield process
    process.stdin.close()
    process.wait(timeout=60)


@pytest.fixture(params=["matrices", "kernel"])
def resample(request, tmp_path):
    """Each resampler with resample_boxes' signature. The Triton kernel runs compiled where
    there is a GPU, otherwise through Triton's interpreter, which must be chosen before Triton
    is imported: so in a child process (``interpreter``). (Triton 3.6's interpreter cannot run
    the kernel's loops with run-time bounds; 3.9's can.)"""
    if request.param == "matrices":
        return functools.partial(resample_boxes, method="matrices")
    pytest.importorskip("triton", reason="the test extra installs Triton; this environment lacks it")
    if torch.cuda.is_available():
        def on_gpu(images):
            if isinstance(images, ImageTable):
                return ImageTable([h.cuda() for h in images.holders], images.layout, images.sizes, images.channels)
            return [im.cuda() for im in images]

        def compiled(images, boxes, size, flip=None, **form):
            if form.get("affine") is not None:
                form["affine"] = form["affine"].cuda()
            return resample_boxes(on_gpu(images), boxes, size, flip, method="kernel", **form).cpu()
        return compiled

    process = request.getfixturevalue("interpreter")

    def interpreted(images, boxes, size, flip=None, **form):
        inputs, output = tmp_path / "inputs.pt", tmp_path / "output.pt"
        torch.save(((images, boxes, size, flip), form), inputs)
        process.stdin.write(f"{inputs} {output}\n")
        process.stdin.flush()
        answer = process.stdout.readline().strip()
        assert answer == "ok", answer or "the interpreter's process ended"
        return torch.load(output)
    return interpreted


# --- geometry ---------------------------------------------------------------------------------------------

def test_random_resized_boxes_follow_the_area_and_ratio_rules():
    heights = torch.tensor([375, 500, 64, 224] * 250)
    widths = torch.tensor([500, 333, 64, 900] * 250)
    boxes = random_resized_boxes(heights, widths, torch.Generator().manual_seed(0))
    top, left, h, w = boxes.unbind(1)
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= heights).all() and (left + w <= widths).all()
    assert torch.equal(boxes, boxes.round())  # whole pixels, as torchvision's crop takes
    area = h * w / (heights * widths)
    assert area.min() >= 0.08 * 0.9 and area.max() <= 1.0
    ratio = w / h
    # whole-pixel rounding moves the ratio slightly past the bounds on small boxes
    assert ratio.min() >= 0.75 * 0.9 and ratio.max() <= 4 / 3 * 1.1
    assert area.std() > 0.15 and (top > 0).float().mean() > 0.5  # spread out, not one fixed crop
    again = random_resized_boxes(heights, widths, torch.Generator().manual_seed(0))
    other = random_resized_boxes(heights, widths, torch.Generator().manual_seed(1))
    assert torch.equal(boxes, again) and not torch.equal(boxes, other)


def test_random_resized_box_falls_back_to_the_centre_for_extreme_shapes():
    # a 10 x 1000 strip: no box with ratio <= 4/3 covers 8% of it, so the centred fallback is used
    box = random_resized_boxes(torch.tensor([10]), torch.tensor([1000]), torch.Generator().manual_seed(0))[0]
    assert box.tolist() == [0.0, float((1000 - 13) // 2), 10.0, 13.0]


@pytest.mark.parametrize("size", [224, 24])
def test_resampling_matches_pil_antialiased_resize_of_the_box(size, resample):
    arrays = [photo(h, w, seed) for seed, (h, w) in enumerate([(75, 100), (120, 67), (40, 40), (33, 90)])]
    heights = torch.tensor([a.shape[0] for a in arrays])
    widths = torch.tensor([a.shape[1] for a in arrays])
    boxes = random_resized_boxes(heights, widths, torch.Generator().manual_seed(3))
    flip = torch.tensor([False, True, False, True])
    out = resample([chw(a) for a in arrays], boxes, size, flip)
    assert out.shape == (4, 3, size, size) and out.dtype == torch.float32
    for i, array in enumerate(arrays):
        top, left, h, w = boxes[i].tolist()
        reference = np.asarray(Image.fromarray(array).resize((size, size), Image.Resampling.BILINEAR,
                                                             box=(left, top, left + w, top + h)), dtype=np.float64)
        if flip[i]:
            reference = reference[:, ::-1]
        difference = np.abs(out[i].permute(1, 2, 0).numpy().round() - reference)
        # PIL rounds to 8 bits between its two passes; the GPU path does not
        assert difference.max() <= 1 and difference.mean() < 0.3, (i, difference.max(), difference.mean())


def test_resampling_can_normalise_and_lay_out_the_batch_for_training(resample):
    """The finished batch (scaled and shifted per channel, bf16, channels_last) made in the
    resampler's one pass equals the 0..255 batch finished afterwards."""
    arrays = [photo(h, w, seed) for seed, (h, w) in enumerate([(75, 100), (120, 67), (40, 40)])]
    images = [chw(a) for a in arrays]
    boxes = random_resized_boxes(torch.tensor([75, 120, 40]), torch.tensor([100, 67, 40]),
                                 torch.Generator().manual_seed(7))
    flip = torch.tensor([True, False, True])
    affine = torch.tensor([[1 / 58.4, 1 / 57.1, 1 / 57.4], [-2.12, -2.04, -1.8]])
    raw = resample(images, boxes, 20, flip)
    finished = resample(images, boxes, 20, flip, affine=affine, dtype=torch.bfloat16, channels_last=True)
    assert finished.shape == (3, 3, 20, 20) and finished.dtype == torch.bfloat16
    assert finished.is_contiguous(memory_format=torch.channels_last)
    expected = raw * affine[0].view(1, -1, 1, 1) + affine[1].view(1, -1, 1, 1)
    # one conversion to bf16 apart (8 significant bits; compiled Triton rounds to nearest, its
    # interpreter truncates), and the fp32 sums' few ulps
    assert ((finished.float() - expected).abs() <= expected.abs() * 2**-7 + 1e-5).all()
    assert expected.abs().max() > 1 and expected.min() < 0  # the affine did move the values
    plain = resample(images, boxes, 20, flip, affine=affine)
    assert plain.dtype == torch.float32 and plain.is_contiguous()
    assert torch.allclose(plain, expected, atol=1e-5)


def test_resampling_reads_images_through_their_strides(resample):
    """Images decoded on the CPU arrive as height x width x channels views, grey ones as one
    channel read three times: the result equals that of contiguous (C, H, W) copies."""
    arrays = [photo(h, w, seed) for seed, (h, w) in enumerate([(75, 100), (41, 66)])]
    grey = photo(50, 60, 9)[:, :, :1]
    views = [torch.from_numpy(a).permute(2, 0, 1) for a in arrays] + [torch.from_numpy(grey).permute(2, 0, 1)
                                                                       .expand(3, -1, -1)]
    assert not any(v.is_contiguous() for v in views)
    boxes = random_resized_boxes(torch.tensor([75, 41, 50]), torch.tensor([100, 66, 60]),
                                 torch.Generator().manual_seed(5))
    flip = torch.tensor([True, False, True])
    out = resample(views, boxes, 32, flip)
    assert torch.allclose(out, resample([v.contiguous() for v in views], boxes, 32, flip), atol=1e-3)
    # the same values; the compiled kernel may sum a channel's taps in another order (one ulp)
    assert torch.allclose(out[2, 0], out[2, 1], rtol=1e-6) and torch.allclose(out[2, 0], out[2, 2], rtol=1e-6)
    assert not torch.allclose(out[0, 0], out[0, 1], atol=1)  # a colour image's channels do differ


def test_an_image_table_reads_packed_images_in_place(resample):
    """A batch as the stream loader builds it: nvJPEG's planes and Pillow's height x width x
    channels images, each packed one after another in one buffer, in a shuffled order with a
    repeat. Resampling the table equals resampling contiguous copies."""
    planar = [chw(photo(h, w, seed)) for seed, (h, w) in enumerate([(60, 80), (45, 31)])]
    interleaved = [photo(52, 70, 7), photo(40, 50, 8)[:, :, :1]]
    planes = ImageTable.planar(torch.cat([p.reshape(-1) for p in planar]), np.array([(60, 80), (45, 31)]),
                               np.array([0, 3 * 60 * 80]))
    pixels = ImageTable.interleaved(torch.from_numpy(np.concatenate([a.reshape(-1) for a in interleaved])),
                                    np.array([a.shape for a in interleaved]))
    rows = [3, 0, 2, 1, 0]
    table = ImageTable.concat([planes, pixels]).take(rows)
    expected = [(planar + [chw(interleaved[0]), chw(interleaved[1]).expand(3, -1, -1).contiguous()])[r] for r in rows]
    assert all(torch.equal(v, e) for v, e in zip(table.views(), expected))
    boxes = random_resized_boxes(torch.tensor([e.shape[1] for e in expected]),
                                 torch.tensor([e.shape[2] for e in expected]), torch.Generator().manual_seed(3))
    flip = torch.tensor([True, False, False, True, False])
    assert torch.allclose(resample(table, boxes, 24, flip), resample(expected, boxes, 24, flip), atol=1e-3)


def test_resampling_in_several_canvas_chunks_keeps_each_image_in_its_place(monkeypatch):
    sizes = [(90, 60), (40, 50), (120, 100), (33, 90), (64, 64), (50, 41)]
    images = [chw(photo(h, w, seed)) for seed, (h, w) in enumerate(sizes)]
    boxes = random_resized_boxes(torch.tensor([h for h, _ in sizes]), torch.tensor([w for _, w in sizes]),
                                 torch.Generator().manual_seed(5))
    flip = torch.tensor([True, False, False, True, False, True])
    whole = resample_boxes(images, boxes, 16, flip)
    canvas = crops._canvas
    canvases = []
    monkeypatch.setattr(crops, "_CANVAS_BUDGET", 3 * 64 * 64 * 2)  # two 64 x 64 images per chunk at most
    monkeypatch.setattr(crops, "_canvas", lambda members, *rest: canvases.append(len(members)) or canvas(members, *rest))
    chunked = resample_boxes(images, boxes, 16, flip)
    assert sum(canvases) == len(images) and len(canvases) >= 3
    assert torch.allclose(chunked, whole, atol=1e-3)
    alone = torch.cat([resample_boxes([im], boxes[i:i + 1], 16, flip[i:i + 1]) for i, im in enumerate(images)])
    assert torch.allclose(alone, whole, atol=1e-3)


@pytest.mark.gpu
def test_the_compiled_kernel_agrees_with_the_matrix_products_on_extreme_shapes():
    # downscaling 3000 px to 224 needs 29 taps per axis; strips one pixel wide; upscaling
    generator = torch.Generator().manual_seed(0)
    sizes = [(375, 500), (3000, 2000), (40, 31), (1, 700), (900, 12)] * 4
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=generator).cuda() for h, w in sizes]
    heights, widths = torch.tensor([h for h, _ in sizes]), torch.tensor([w for _, w in sizes])
    flip = torch.rand(len(sizes), generator=generator) < 0.5
    train_boxes, eval_boxes = random_resized_boxes(heights, widths, generator), centre_boxes(heights, widths, 224)
    for boxes, flips in [(train_boxes, flip), (eval_boxes, None)]:
        kernel = resample_boxes(images, boxes, 224, flips, method="kernel")
        matrices = resample_boxes(images, boxes, 224, flips, method="matrices")
        assert (kernel - matrices).abs().max() < 0.5  # the matrix products run in fp16


def test_centre_boxes_equal_resize_then_centre_crop(resample):
    arrays = [photo(h, w, seed) for seed, (h, w) in enumerate([(75, 100), (100, 61), (50, 50)])]
    heights = torch.tensor([a.shape[0] for a in arrays])
    widths = torch.tensor([a.shape[1] for a in arrays])
    out = resample([chw(a) for a in arrays], centre_boxes(heights, widths, 32), 32)
    short = round(32 / 0.875)
    for i, array in enumerate(arrays):
        h, w = array.shape[:2]
        rh, rw = (short, int(short * w / h)) if h <= w else (int(short * h / w), short)
        resized = Image.fromarray(array).resize((rw, rh), Image.Resampling.BILINEAR)
        top, left = int(round((rh - 32) / 2)), int(round((rw - 32) / 2))
        reference = np.asarray(resized.crop((left, top, left + 32, top + 32)), dtype=np.float64)
        difference = np.abs(out[i].permute(1, 2, 0).numpy().round() - reference)
        assert difference.max() <= 1, (i, difference.max())


# --- shards -----------------------------------------------------------------------------------------------

def test_shard_order_gives_ranks_disjoint_whole_shards_and_equal_steps():
    sizes = [30, 25, 40, 10, 33, 20]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    orders = [ShardOrder(sizes, batch_size=8, train=True, seed=5, rank=r, world_size=2, window=2) for r in range(2)]
    assert len(orders[0]) == len(orders[1]) > 0
    for epoch in range(3):
        served = [o.epoch_indices(epoch) for o in orders]
        assert all(len(s) == len(orders[0]) * 8 for s in served)
        owned = [set(shard_of[s.numpy()]) for s in served]
        assert not owned[0] & owned[1]  # a shard belongs to one rank
        assert not set(served[0].tolist()) & set(served[1].tolist())
        for s in served:
            assert len(set(s.tolist())) == len(s)  # nothing twice within an epoch
            # reads stay within a window of 2 shards at a time: each run of samples spans at most 2
            window_shards = [len(set(shard_of[s[i:i + 8].numpy()])) for i in range(0, len(s), 8)]
            assert max(window_shards) <= 2 * 2
    assert not torch.equal(orders[0].epoch_indices(0), orders[0].epoch_indices(1))
    again = ShardOrder(sizes, batch_size=8, train=True, seed=5, rank=0, world_size=2, window=2)
    assert torch.equal(again.epoch_indices(1), orders[0].epoch_indices(1))
    # evaluation: each rank reads its shards in order, and together the ranks read everything once
    evals = [ShardOrder(sizes, batch_size=8, train=False, seed=5, rank=r, world_size=2) for r in range(2)]
    together = torch.cat([o.epoch_indices(0) for o in evals])
    assert sorted(together.tolist()) == list(range(int(starts[-1])))


def test_more_processes_than_shards_is_an_error():
    with pytest.raises(GpuaccelError, match="2 training shard"):
        ShardOrder([10, 10], batch_size=4, train=True, seed=0, rank=0, world_size=3)
    # evaluation may have fewer shards than processes: the last one reads nothing
    idle = ShardOrder([10, 10], batch_size=4, train=False, seed=0, rank=2, world_size=3)
    assert len(idle) == 0 and len(idle.epoch_indices(0)) == 0


def jpeg_bytes(label: int, seed: int, size=(40, 52)) -> bytes:
    """A JPEG whose dominant colour channel is its label (0, 1, 2)."""
    rng = np.random.default_rng(seed)
    array = rng.integers(0, 60, (size[0], size[1], 3)).astype(np.uint8)
    array[..., label] += 180
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_shards(root: Path, split: str, shards: int, per_shard: int, bad: set[tuple[int, int]] = frozenset()):
    (root / split).mkdir(parents=True, exist_ok=True)
    for s in range(shards):
        with tarfile.open(root / split / f"{split}-{s:04d}.tar", "w") as tar:
            for i in range(per_shard):
                label = (s + i) % 3
                data = b"not a jpeg at all" if (s, i) in bad else jpeg_bytes(label, s * 1000 + i)
                for name, payload in ((f"{s:04d}_{i:04d}.jpg", data), (f"{s:04d}_{i:04d}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(payload)
                    tar.addfile(info, io.BytesIO(payload))
    return root


def loader_of(ds: StreamingDataset, train: bool, **options):
    return stream_loader(ds, train=train, batch_size=options.pop("batch_size", 8), device=CPU, mean=(0.5,) * 3,
                     std=(0.25,) * 3, **options)


def test_shards_are_indexed_with_labels_and_stream_the_right_images(tmp_path):
    root = write_shards(tmp_path / "shards", "train", 3, 20)
    write_shards(root, "val", 1, 12)
    ds = open_dataset(str(root), image_size=24)  # a directory of shards is always streamed
    assert isinstance(ds, StreamingDataset)
    assert (len(ds.train), len(ds.test), ds.num_classes) == (60, 12, 3)
    assert ds.train.names[0].endswith("train-0000.tar:0000_0000.jpg")
    for train in (True, False):
        loader = loader_of(ds, train)
        for x, y in loader.batches(0):
            assert x.shape[1:] == (3, 24, 24)
            # each image's dominant channel is its label, whatever the crop
            assert torch.equal(x.mean(dim=(2, 3)).argmax(dim=1), y)


def test_stream_batches_are_deterministic_and_resume_mid_epoch(tmp_path):
    root = write_shards(tmp_path / "shards", "train", 2, 16)
    write_shards(root, "val", 1, 4)
    ds = open_dataset(str(root), image_size=16)
    loader = loader_of(ds, True, seed=1, workers=2)
    full = list(loader.batches(epoch=2))
    following = list(loader.batches(epoch=3))  # its reader processes went on into epoch 3
    # batches made by several pipeline threads are the same batches, in the same order
    rest = list(loader_of(ds, True, seed=1, threads=2).batches(epoch=2, start=1))
    assert len(rest) == len(full) - 1
    for (xa, ya), (xb, yb) in zip(full[1:], rest):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    other = list(loader_of(ds, True, seed=1, threads=3).batches(epoch=3))
    assert not torch.equal(full[0][0], other[0][0])
    for (xa, ya), (xb, yb) in zip(following, other, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_evaluation_batches_are_the_same_centre_crops_whatever_the_seed_and_epoch(tmp_path):
    root = write_shards(tmp_path / "shards", "train", 1, 8)
    write_shards(root, "val", 1, 12)
    ds = open_dataset(str(root), image_size=16)
    first, other = list(loader_of(ds, False, seed=1).batches(0)), list(loader_of(ds, False, seed=2).batches(3))
    for (xa, ya), (xb, yb) in zip(first, other, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    train = list(loader_of(ds, True, seed=1).batches(0))
    sample = loader_of(ds, False, seed=1).sample(4)[0]  # (float32: centre crops, normalised, not cast)
    assert sample.dtype == torch.float32 and sample.shape == (4, 3, 16, 16)
    assert not torch.equal(train[0][0], next(loader_of(ds, True, seed=2).batches(0))[0])


def test_any_share_of_a_batch_decoded_by_any_number_of_reader_processes_gives_the_same_batches(tmp_path):
    root = write_shards(tmp_path / "shards", "train", 3, 12)
    write_shards(root, "val", 1, 6)
    ds = open_dataset(str(root), image_size=16)
    reference = list(loader_of(ds, True, seed=2, workers=0, cpu_decode=1.0).batches(1))
    for workers, share in ((0, 0.0), (2, 0.5), (2, 1.0), (1, 0.3)):
        batches = list(loader_of(ds, True, seed=2, workers=workers, cpu_decode=share).batches(1))
        assert len(batches) == len(reference)
        for (x, y), (x_ref, y_ref) in zip(batches, reference):
            assert torch.equal(x, x_ref) and torch.equal(y, y_ref), (workers, share)
    with pytest.raises(GpuaccelError, match="cpu_decode must be a fraction"):
        loader_of(ds, True, cpu_decode=1.5)


def test_the_reader_processes_decode_every_image_unless_nvjpeg_is_there_and_they_are_few(tmp_path):
    assert default_cpu_decode(on_gpu=False, workers=1) == 1.0
    assert default_cpu_decode(on_gpu=True, workers=PILLOW_READERS) == 1.0
    assert default_cpu_decode(on_gpu=True, workers=PILLOW_READERS - 1) == 0.0
    root = write_shards(tmp_path / "shards", "train", 1, 8)
    write_shards(root, "val", 1, 4)
    ds = open_dataset(str(root), image_size=16)
    assert loader_of(ds, True, workers=2).transform.decoder == "pillow"
    if torch.cuda.is_available():
        options = dict(train=True, batch_size=8, device=torch.device("cuda"), mean=(0.5,) * 3, std=(0.25,) * 3)
        many, few = (stream_loader(ds, workers=workers, **options).transform for workers in (PILLOW_READERS, 2))
        assert (many.cpu_decode, many.batch_decoder, many.decoder) == (1.0, None, "pillow")
        assert few.cpu_decode == 0.0 and few.decoder.startswith("nvjpeg")


@pytest.mark.gpu
def test_nvjpeg_and_the_reader_processes_share_a_batch_on_a_gpu(tmp_path):
    root = write_shards(tmp_path / "shards", "train", 2, 16)
    write_shards(root, "val", 1, 4)
    ds = open_dataset(str(root), image_size=16)
    passes = {share: list(stream_loader(ds, train=True, batch_size=8, device=torch.device("cuda"), mean=(0.5,) * 3,
                                        std=(0.25,) * 3, seed=2, cpu_decode=share).batches(1))
              for share in (0.0, 0.5, 1.0)}
    grey_level = 1 / 255 / 0.25
    for step, (x_pil, y_pil) in enumerate(passes[1.0]):
        for share in (0.0, 0.5):
            x, y = passes[share][step]
            assert torch.equal(y, y_pil)
            # the two decoders' inverse DCTs round differently, by about a grey level
            assert (x - x_pil).abs().mean() < 2 * grey_level, (share, step)


def test_jpeg_frame_headers_give_the_size_and_what_the_hardware_decoder_takes():
    array = photo(37, 53, 1)
    cases = [({}, True), ({"subsampling": 0}, True), ({"subsampling": 1}, True), ({"progressive": True}, False)]
    for options, hardware in cases:
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, "JPEG", **options)
        assert nvjpeg.frame(buffer.getvalue()) == (37, 53, hardware, 1), options
    for mode, hardware in (("L", True), ("CMYK", False)):
        buffer = io.BytesIO()
        Image.fromarray(array).convert(mode).save(buffer, "JPEG")
        assert nvjpeg.frame(buffer.getvalue()) == (37, 53, hardware, 1), mode
    assert nvjpeg.frame(b"not a jpeg at all") is None
    assert nvjpeg.frame(jpeg_bytes(0, 0)[:20]) is None  # cut short before its frame header


def sideways_jpeg(orientation: int = 6) -> tuple[bytes, np.ndarray]:
    """A 6 x 10 JPEG whose EXIF says to turn it (6: 90 degrees clockwise), and how it looks upright."""
    from PIL import ImageOps

    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    Image.fromarray(photo(6, 10, 3)).save(buffer, "JPEG", exif=exif.tobytes(), quality=95)
    with Image.open(io.BytesIO(buffer.getvalue())) as img:
        upright = np.asarray(ImageOps.exif_transpose(img).convert("RGB"))
    return buffer.getvalue(), upright


def test_exif_orientation_is_read_from_the_header_and_decoded_images_are_upright(tmp_path):
    from gpuaccel.data.images import ImageSource, decode_images

    blob, upright = sideways_jpeg(6)
    assert nvjpeg.frame(blob) == (6, 10, True, 6)  # the stored size; the orientation says to turn it
    # big-endian TIFF, orientation 3 (upside down), as some cameras write it
    segment = b"Exif\x00\x00MM\x00\x2a\x00\x00\x00\x08\x00\x01" + b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x03\x00\x00"
    assert nvjpeg.exif_orientation(segment) == 3
    assert nvjpeg.exif_orientation(b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta>") == 1  # XMP, not EXIF
    assert upright.shape == (10, 6, 3)
    images, kept, bad = decode_images([ImageSource("sideways.jpg", data=blob),
                                       ImageSource("upright.jpg", data=jpeg_bytes(0, 1, size=(10, 6)))])
    assert images.shape == (2, 3, 10, 6) and not bad
    assert np.array_equal(images[0].transpose(1, 2, 0), upright)
    # resized to a model's size, each image's own size is still known, upright (its boxes are scaled back to it)
    images, kept, bad, sizes = decode_images([ImageSource("sideways.jpg", data=blob), ImageSource("bad.jpg", data=b"x"),
                                              ImageSource("wide.jpg", data=jpeg_bytes(0, 1, size=(12, 4)))],
                                             image_size=8, skip_bad=True, sizes=True)
    assert images.shape == (2, 3, 8, 8) and kept == [0, 2] and bad == ["bad.jpg"] and sizes == [(6, 10), (4, 12)]


@pytest.mark.gpu
def test_the_gpu_decoders_leave_sideways_jpegs_to_pillow_which_turns_them_upright():
    from gpuaccel.data.images import ImageSource, _decode_on_gpu

    pytest.importorskip("torchvision")
    blob, upright = sideways_jpeg(6)
    plain = jpeg_bytes(0, 1, size=(10, 6))
    results = _decode_on_gpu([ImageSource("a.jpg", data=plain), ImageSource("b.jpg", data=blob),
                              ImageSource("c.jpg", data=plain)], torch.device("cuda"))
    assert [r[0].shape for r in results] == [(10, 6, 3)] * 3
    assert np.array_equal(results[1][0], upright)


def test_the_gpu_decoder_opens_only_on_a_gpu_and_by_a_known_kind():
    assert nvjpeg.BatchDecoder.open(torch.device("cpu")) is None  # nvJPEG only decodes on a GPU
    with pytest.raises(ValueError, match="direct; got 'hybrid'"):
        nvjpeg.BatchDecoder.open(torch.device("cpu"), "hybrid")


def direct_decoder(monkeypatch, kind: str = "direct") -> nvjpeg.BatchDecoder:
    decoder = nvjpeg.BatchDecoder.open(torch.device("cuda"), kind)
    if decoder is None:
        pytest.skip(f"no nvJPEG {kind} decoder here")
    return decoder


def decode_directly(decoder: nvjpeg.BatchDecoder, blobs: list[bytes]) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The planes, starts and (height, width) of ``blobs`` decoded in one call, from pinned memory."""
    frames = [nvjpeg.frame(b) for b in blobs]
    data = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).pin_memory()
    lengths = np.array([len(b) for b in blobs])
    sizes = np.array([(f.height, f.width) for f in frames])
    planes, starts = decoder.decode(data, np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths, sizes[:, 0],
                                    sizes[:, 1])
    return planes, starts, sizes


@pytest.mark.gpu
@pytest.mark.parametrize("kind, tolerance", [("direct", 0)])
def test_the_direct_decoders_give_torchvisions_pixels(monkeypatch, kind, tolerance):
    from torchvision.io import ImageReadMode, decode_jpeg

    decoder = direct_decoder(monkeypatch, kind)
    blobs = []
    for k, options in enumerate([{}, {"subsampling": 0}, {"subsampling": 1}, {}, {}]):
        buffer = io.BytesIO()
        image = Image.fromarray(photo(40 + 7 * k, 90 - 9 * k, k))
        (image.convert("L") if k == 4 else image).save(buffer, "JPEG", quality=85, **options)
        blobs.append(buffer.getvalue())
    planes, starts, sizes = decode_directly(decoder, blobs)
    expected = decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs],
                           mode=ImageReadMode.RGB, device="cuda")
    for view, reference in zip(ImageTable.planar(planes, sizes, starts).views(), expected):
        assert (view.int() - reference.int()).abs().max() <= tolerance


@pytest.mark.gpu
def test_the_direct_decoder_decodes_batches_from_several_threads_at_once(monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from torchvision.io import ImageReadMode, decode_jpeg

    decoder = direct_decoder(monkeypatch)
    batches = [[jpeg_bytes(k % 3, 100 * b + k, size=(40 + 9 * b, 60 + 3 * k)) for k in range(6 + b % 2)]
               for b in range(8)]

    def decode_on_a_stream_of_its_own(blobs):
        with torch.cuda.stream(torch.cuda.Stream()):
            planes, starts, sizes = decode_directly(decoder, blobs)
            torch.cuda.current_stream().synchronize()
            return planes, starts, sizes

    with ThreadPoolExecutor(4) as pool:
        decoded = list(pool.map(decode_on_a_stream_of_its_own, batches))
    for blobs, (planes, starts, sizes) in zip(batches, decoded):
        expected = decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs],
                               mode=ImageReadMode.RGB, device="cuda")
        for view, reference in zip(ImageTable.planar(planes, sizes, starts).views(), expected):
            assert torch.equal(view, reference)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["torchvision", "direct"])
def test_gpu_decoding_leaves_memory_that_queued_kernels_still_read_alone(monkeypatch, route):
    # nvJPEG's hardware decoder writes when called, not in stream order; the caching allocator
    # hands it blocks freed on the stream while kernels queued there still read them
    from gpuaccel.data.stream import _decode_on_gpu

    device = torch.device("cuda")
    blobs = [jpeg_bytes(k % 3, k) for k in range(8)]
    height, width = nvjpeg.frame(blobs[0])[:2]
    if route != "torchvision":
        decoder = direct_decoder(monkeypatch, route)
        decode, block = (lambda: decode_directly(decoder, blobs)), len(blobs) * 3 * height * width
    else:
        decode, block = (lambda: _decode_on_gpu([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs],
                                                device)), 3 * height * width
    wrong = 0
    with torch.cuda.stream(torch.cuda.Stream(device)):
        for _ in range(5):
            held = [torch.ones(block, dtype=torch.uint8, device=device) for _ in range(2 * len(blobs))]
            torch.cuda.current_stream(device).synchronize()
            torch.cuda._sleep(50_000_000)  # tens of milliseconds of GPU time ahead of the sums
            sums = [t.sum(dtype=torch.int64) for t in held]
            del held  # free, while the sums that read the blocks are still queued
            decode()
            wrong += sum(int(total) != block for total in sums)
    assert wrong == 0


@pytest.mark.parametrize("share", [0.0, 1.0])  # failing in a reader process, or in the loader's thread
def test_a_corrupt_jpeg_in_a_shard_is_named_or_skipped_and_counted(tmp_path, share):
    root = write_shards(tmp_path / "shards", "train", 2, 12, bad={(1, 5)})
    write_shards(root, "val", 1, 4)
    ds = open_dataset(str(root), image_size=16)
    with pytest.raises(GpuaccelError, match=r"train-0001\.tar:0001_0005\.jpg.*skip_bad"):
        for _ in loader_of(ds, True, cpu_decode=share).batches(0):
            pass
    batches = list(loader_of(ds, True, skip_bad=True, cpu_decode=share).batches(0))
    assert all(x.shape[0] == 8 for x, _ in batches)  # the bad image's place is taken: shapes stay static
    assert ds.skipped == [str(root / "train" / "train-0001.tar") + ":0001_0005.jpg"]


def test_training_from_shards_and_from_a_streamed_folder(capsys, tmp_path):
    root = write_shards(tmp_path / "shards", "train", 2, 24)
    write_shards(root, "val", 1, 12)
    common = ["--model", "mlp", "--image-size", "16", "--epochs", "2", "--batch-size", "8", "--lr", "0.05",
              "--json", "--quiet"]
    # two reader processes: on a GPU, too few to leave every image to Pillow
    code, out, err = run(capsys, "train", "--data", str(root), "--run-dir", str(tmp_path / "a"), "--workers", "2",
                         *common)
    assert code == 0, err
    summary = json.loads(out)
    assert summary["train_samples"] == 48 and summary["test_samples"] == 12 and summary["metrics"]["accuracy"] > 0.5
    assert summary["jpeg_decoder"].startswith("nvjpeg" if torch.cuda.is_available() else "pillow")

    folder = make_image_folder(tmp_path / "img", per_class=(12, 4), size=20, ext="jpg")
    code, out, err = run(capsys, "train", "--data", str(folder), "--loader", "stream", "--run-dir",
                         str(tmp_path / "b"), *common)
    assert code == 0, err
    assert json.loads(out)["test_samples"] == 4 * len(CLASSES)


def test_the_trainer_sets_the_next_epochs_batches_going_before_it_evaluates(capsys, tmp_path, monkeypatch):
    from gpuaccel.data.stream import JpegPasses
    from gpuaccel.train.trainer import Trainer

    events = []
    batches, evaluate = PrefetchLoader.batches, Trainer.evaluate

    def logged_batches(self, epoch=0, start=0):
        if isinstance(self.passes, JpegPasses) and self.passes.order.train:
            events.append(("batches", epoch))
        return batches(self, epoch, start)

    def logged_evaluate(self, each_shape=False):
        if not each_shape:  # (not the warm-up's pass)
            events.append(("evaluate", self.state.epoch))
        return evaluate(self, each_shape)

    monkeypatch.setattr(PrefetchLoader, "batches", logged_batches)
    monkeypatch.setattr(Trainer, "evaluate", logged_evaluate)
    root = write_shards(tmp_path / "shards", "train", 2, 16)
    write_shards(root, "val", 1, 8)
    common = ["--data", str(root), "--model", "mlp", "--image-size", "16", "--batch-size", "8", "--json", "--quiet"]
    code, out, err = run(capsys, "train", *common, "--epochs", "3", "--run-dir", str(tmp_path / "a"))
    assert code == 0, err
    # epoch k+1's batches are asked for before the evaluation that ends epoch k (state.epoch is k+1 by then)
    assert [e for e in events if e[0] == "batches"][:3] == [("batches", 0), ("batches", 1), ("batches", 2)]
    assert events.index(("batches", 1)) < events.index(("evaluate", 1))
    assert events.index(("batches", 2)) < events.index(("evaluate", 2))
    assert ("batches", 3) not in events  # none after the last epoch
    # a run that stops at its target leaves the batches it set going for the next epoch stopped
    code, out, err = run(capsys, "train", *common, "--epochs", "5", "--target", "accuracy=0.01",
                         "--run-dir", str(tmp_path / "b"))
    assert code == 0, err
    assert json.loads(out)["stopped_by"] == "target"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("gpuaccel-prefetch")]


def test_stream_errors(capsys, tmp_path):
    assert_user_error(capsys, ["train", "--data", "digits", "--loader", "stream"], "--loader stream", "digits")
    root = write_shards(tmp_path / "shards", "train", 2, 8)
    assert_user_error(capsys, ["train", "--data", str(root)], "no validation shards")
    write_shards(root, "val", 1, 4)
    assert_user_error(capsys, ["train", "--data", str(root), "--cutout", "4"], "--cutout")
    assert_user_error(capsys, ["train", "--data", str(root), "--cpu-decode", "1.5"], "--cpu-decode must be a fraction")


def test_a_corrupt_jpeg_in_a_shard_from_the_cli(capsys, tmp_path):
    root = write_shards(tmp_path / "shards", "train", 2, 16, bad={(0, 3)})
    write_shards(root, "val", 1, 8)
    common = ["--model", "mlp", "--image-size", "16", "--epochs", "1", "--batch-size", "8", "--quiet"]
    assert_user_error(capsys, ["train", "--data", str(root), *common], "train-0000.tar:0000_0003.jpg", "--skip-bad")
    code, out, err = run(capsys, "train", "--data", str(root), "--skip-bad", "--json", "--run-dir",
                         str(tmp_path / "r"), *common)
    assert code == 0, err
    assert json.loads(out)["skipped_samples"] == 1


@pytest.mark.parametrize("loader", ["stream", "cpu"])
def test_reader_processes_stop_when_the_run_ends(capsys, tmp_path, loader):
    """A finished run leaves no reader processes behind for the garbage collector: collected in
    a reference cycle, a DataLoader's workers never hear the stop and PyTorch waits 5 s for each
    (a second run in the same process stalled minutes with 14 of them)."""
    import multiprocessing

    root = make_image_folder(tmp_path / "images", per_class=(8, 4), size=16, ext="jpg")
    code, _, err = run(capsys, "train", "--data", str(root), "--loader", loader, "--workers", "2", "--model", "mlp",
                       "--image-size", "16", "--batch-size", "8", "--epochs", "2", "--run-dir", str(tmp_path / "r"),
                       "--quiet", "--no-monitor")
    assert code == 0, err
    assert multiprocessing.active_children() == []
