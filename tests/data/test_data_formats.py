"""Every data format is read into the same uint8 NCHW form, with the right labels and classes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import CLASSES, balanced_labels, make_image_folder, make_tar, pattern_images, write_idx
from PIL import Image

from gpuaccel import GpuaccelError, load_dataset
from gpuaccel.data import formats, parse_spec


def test_digits_is_embedded_and_split_stratified():
    ds = load_dataset("digits")
    assert ds.train_images.shape[1:] == (1, 8, 8) and ds.train_images.dtype == np.uint8
    assert ds.num_classes == 10 and len(ds.train_labels) + len(ds.test_labels) == 1797
    assert abs(len(ds.test_labels) / 1797 - 0.2) < 0.01
    assert set(np.unique(ds.test_labels)) == set(range(10))  # every class held out
    assert ds.train_images.max() > 200  # scaled from 0..16 to 0..255


def test_digits_are_scikit_learns_read_without_importing_it():
    """``formats.bundled_digits`` reads the file scikit-learn ships (importing ``sklearn.datasets``
    cost every digits command 1.5 s): the same arrays as ``load_digits``, and no scikit-learn import."""
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    images, labels = formats.bundled_digits()
    reference = load_digits()
    np.testing.assert_array_equal(images, reference.images)
    np.testing.assert_array_equal(labels, reference.target)
    assert images.dtype == reference.images.dtype and labels.dtype == reference.target.dtype
    check = ("import sys; from gpuaccel.data.formats import bundled_digits; bundled_digits(); "
             "sys.exit('sklearn' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", check]).returncode == 0, "reading the digits imported scikit-learn"


def test_mnist_idx_gz_and_raw(mnist_dir, tmp_path):
    ds = load_dataset(str(mnist_dir))
    assert ds.name == "mnist" and ds.train_images.shape == (300, 1, 16, 16) and ds.test_images.shape == (90, 1, 16, 16)
    expected = balanced_labels(300, 6, 0)
    np.testing.assert_array_equal(ds.train_labels, expected)
    np.testing.assert_array_equal(ds.train_images[:, 0], pattern_images(expected, 16, 1, 0))
    raw = tmp_path / "raw"
    raw.mkdir()
    write_idx(raw / "train-images-idx3-ubyte", pattern_images(expected, 16, 1, 0), gz=False)
    write_idx(raw / "train-labels-idx1-ubyte", expected.astype(np.uint8), gz=False)
    ds2 = load_dataset(f"idx:{raw}")  # no test files: a held-out split is carved out
    assert len(ds2.train_labels) + len(ds2.test_labels) == 300 and len(ds2.test_labels) == 30


def test_idx_truncated_is_a_clear_error(mnist_dir):
    import gzip
    path = mnist_dir / "train-images-idx3-ubyte.gz"
    data = gzip.decompress(path.read_bytes())[:-100]
    path.write_bytes(gzip.compress(data))
    with pytest.raises(GpuaccelError, match="truncated"):
        load_dataset(str(mnist_dir))


def test_cifar_pickles(cifar_dir):
    ds = load_dataset(str(cifar_dir))
    assert ds.name == "cifar10" and ds.classes[:2] == ["c0", "c1"]
    assert ds.train_images.shape == (100, 3, 32, 32) and ds.test_images.shape == (30, 3, 32, 32)
    labels = balanced_labels(50, 10, 1)
    np.testing.assert_array_equal(ds.train_images[:50], pattern_images(labels, 32, 3, 1).transpose(0, 3, 1, 2))


def test_cifar100_layout(tmp_path):
    import pickle
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    for name, n in (("train", 40), ("test", 20)):
        labels = np.arange(n) % 100
        with open(root / name, "wb") as f:
            pickle.dump({b"data": np.zeros((n, 3072), np.uint8), b"fine_labels": labels.tolist()}, f)
    with open(root / "meta", "wb") as f:
        pickle.dump({b"fine_label_names": [f"k{i}".encode() for i in range(100)]}, f)
    ds = load_dataset(f"cifar100:{tmp_path}")
    assert ds.name == "cifar100" and ds.num_classes == 100 and len(ds.test_labels) == 20


def test_image_folder_with_splits(image_folder, cache_dir):
    ds = load_dataset(str(image_folder), cache_dir=cache_dir)
    assert ds.classes == sorted(CLASSES)
    assert ds.train_images.shape == (36, 3, 12, 12) and ds.test_images.shape == (12, 3, 12, 12)
    assert np.bincount(ds.train_labels).tolist() == [12, 12, 12]
    # pixels survive PNG exactly: the first 'circle' training image
    expected = pattern_images(np.zeros(12, dtype=int), 12, 3, seed=0 + len("train"))[0].transpose(2, 0, 1)
    np.testing.assert_array_equal(ds.train_images[0], expected)


def test_image_folder_single_tree_uses_val_split(tmp_path, cache_dir):
    root = make_image_folder(tmp_path / "flat", per_class=(10, 0), split=False)
    ds = load_dataset(str(root), val_split=0.3, cache_dir=cache_dir)
    assert len(ds.test_labels) == 9 and len(ds.train_labels) == 21
    assert np.bincount(ds.test_labels).tolist() == [3, 3, 3]


def test_val_split_refused_when_test_split_exists(image_folder, cache_dir):
    with pytest.raises(GpuaccelError, match="already has a test split"):
        load_dataset(str(image_folder), val_split=0.2, cache_dir=cache_dir)


@pytest.mark.parametrize("mode,channels", [("L", 1), ("P", 3), ("RGBA", 3)])
def test_channel_conversion(tmp_path, cache_dir, mode, channels):
    root = make_image_folder(tmp_path / mode, per_class=(3, 1), mode=mode)
    ds = load_dataset(str(root), cache_dir=cache_dir)
    assert ds.in_channels == channels


def test_mixed_gray_and_rgb_become_rgb(tmp_path, cache_dir):
    root = make_image_folder(tmp_path / "mixed", per_class=(3, 1))
    gray = root / "train" / CLASSES[0] / "0000.png"
    Image.open(gray).convert("L").save(gray)
    ds = load_dataset(str(root), cache_dir=cache_dir)
    assert ds.in_channels == 3
    first = ds.train_images[0]
    assert (first[0] == first[1]).all() and (first[1] == first[2]).all()  # gray repeated over RGB


def test_mixed_sizes_resized_to_most_common_with_warning(tmp_path, cache_dir):
    root = make_image_folder(tmp_path / "sizes", per_class=(3, 1))
    Image.new("RGB", (20, 17), "red").save(root / "train" / CLASSES[1] / "big.png")
    with pytest.warns(UserWarning, match="1 of 13 images are not 12x12"):
        ds = load_dataset(str(root), cache_dir=cache_dir)
    assert ds.train_images.shape[2:] == (12, 12)
    ds = load_dataset(str(root), cache_dir=cache_dir, image_size=8)
    assert ds.train_images.shape[2:] == (8, 8) and ds.test_images.shape[2:] == (8, 8)


def test_jpeg_and_tar_archives(tmp_path, cache_dir):
    root = make_image_folder(tmp_path / "jpg", per_class=(4, 2), ext="jpg")
    from_dir = load_dataset(str(root), cache_dir=cache_dir)
    for name, wrap in (("wrapped.tar.gz", "cifar10"), ("flat.tar", None)):
        archive = make_tar(root, tmp_path / name, wrap)
        from_tar = load_dataset(str(archive), cache_dir=cache_dir)
        assert from_tar.classes == from_dir.classes
        np.testing.assert_array_equal(from_tar.train_images, from_dir.train_images)
        np.testing.assert_array_equal(from_tar.test_labels, from_dir.test_labels)


def test_npz_layouts(npz_file, tmp_path):
    ds = load_dataset(str(npz_file))
    assert ds.train_images.shape == (120, 3, 12, 12) and ds.num_classes == 4
    flat = tmp_path / "flat.npz"
    y = balanced_labels(50, 5)
    np.savez(flat, images=pattern_images(y, 10, 1).astype(np.float32) / 255.0, labels=y,
             classes=np.array(list("abcde")))
    ds = load_dataset(f"npz:{flat}", val_split=0.2)
    assert ds.classes == list("abcde") and ds.train_images.dtype == np.uint8 and len(ds.test_labels) == 10
    # floats in [0, 1] are scaled back to 0..255 (within rounding)
    assert abs(int(ds.train_images.max()) - int(pattern_images(y, 10, 1).max())) <= 1


def test_decoded_images_are_cached(image_folder, cache_dir, monkeypatch):
    first = load_dataset(str(image_folder), cache_dir=cache_dir)
    assert len(list(cache_dir.glob("*.npz"))) == 1

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again despite a warm cache")
    monkeypatch.setattr(formats, "decode_images", no_decoding)
    second = load_dataset(str(image_folder), cache_dir=cache_dir)
    np.testing.assert_array_equal(first.train_images, second.train_images)
    # a changed file changes the key: the cache is not trusted blindly
    path = image_folder / "train" / CLASSES[0] / "0000.png"
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="decoded again"):
        load_dataset(str(image_folder), cache_dir=cache_dir)


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
def test_a_damaged_cache_entry_is_decoded_again_and_replaced(image_folder, cache_dir, damage):
    first = load_dataset(str(image_folder), cache_dir=cache_dir)
    entry = next(cache_dir.glob("*.npz"))
    data = bytearray(entry.read_bytes())
    if damage == "truncated":
        data = data[:len(data) // 2]
    else:  # inside the first array's bytes: the zip's CRC check catches it
        data[200] ^= 0xFF
    entry.write_bytes(bytes(data))
    again = load_dataset(str(image_folder), cache_dir=cache_dir)
    np.testing.assert_array_equal(first.train_images, again.train_images)
    assert load_dataset(str(image_folder), cache_dir=cache_dir).train_images.shape == first.train_images.shape
    assert entry.read_bytes() != bytes(data)  # the entry was written anew


def test_parallel_decoding_matches_serial(tmp_path):
    from gpuaccel.data.images import ImageSource, decode_images
    root = make_image_folder(tmp_path / "many", per_class=(200, 0), size=8, split=False)
    sources = [ImageSource(str(p), str(p)) for p in sorted(root.rglob("*.png"))]
    assert len(sources) >= 512  # large enough for the process pool
    parallel, _, _ = decode_images(sources, workers=2)
    serial, _, _ = decode_images(sources, workers=1)
    np.testing.assert_array_equal(parallel, serial)


@pytest.mark.parametrize("shared", [True, False])
def test_decoders_at_a_given_size_write_into_shared_memory_or_send_their_images(tmp_path, monkeypatch, shared):
    """At a given size the decoding processes write into an anonymous memory file (closed after);
    where the system has none they send the images back: the same images, sizes and bad files."""
    from gpuaccel.data import images as readers

    root = make_image_folder(tmp_path / "many", per_class=(200, 0), size=8, split=False)
    paths = sorted(root.rglob("*.png"))
    Image.fromarray(np.full((12, 10), 77, np.uint8)).save(paths[5])  # grayscale, another size
    paths[7].write_bytes(b"not an image")
    sources = [readers.ImageSource(str(p), str(p)) for p in paths]
    made = []
    if shared:
        probe = readers._shared_rows(1, 1)
        if probe is None:
            pytest.skip("no anonymous memory files here (Linux's memfd_create and /proc)")
        os.close(probe[0])
        shared_rows = readers._shared_rows
        monkeypatch.setattr(readers, "_shared_rows", lambda count, size: made.append(shared_rows(count, size)) or made[-1])
    else:
        monkeypatch.delattr(os, "memfd_create", raising=False)
    parallel = readers.decode_images(sources, image_size=6, workers=2, skip_bad=True, sizes=True)
    serial = readers.decode_images(sources, image_size=6, workers=1, skip_bad=True, sizes=True)
    np.testing.assert_array_equal(parallel[0], serial[0])
    assert parallel[0].shape == (len(paths) - 1, 3, 6, 6) and parallel[0].flags.c_contiguous
    assert parallel[1:] == serial[1:] and parallel[2] == [str(paths[7])] and parallel[3][5] == (10, 12)
    np.testing.assert_array_equal(parallel[0][5], 77)  # the grayscale image over all three channels
    assert len(made) == shared
    for _, path in made:  # (closed: its number gone, or another file's)
        assert not os.path.exists(path) or "gpuaccel-decoded" not in os.readlink(path)


def test_decoded_images_can_be_the_decoders_shared_memory_itself(tmp_path):
    """``view=True`` (infer's chunks): no second copy laid out as (N, C, H, W); where an image is
    grey or bad, a copy as before."""
    from gpuaccel.data import images as readers

    probe = readers._shared_rows(1, 1)
    if probe is None:
        pytest.skip("no anonymous memory files here (Linux's memfd_create and /proc)")
    os.close(probe[0])
    root = make_image_folder(tmp_path / "many", per_class=(200, 0), size=8, split=False)
    sources = [readers.ImageSource(str(p), str(p)) for p in sorted(root.rglob("*.png"))]
    copied = readers.decode_images(sources, image_size=6, workers=2)[0]
    seen = readers.decode_images(sources, image_size=6, workers=2, view=True)[0]
    np.testing.assert_array_equal(seen, copied)
    assert copied.flags.c_contiguous and not seen.flags.c_contiguous and seen.strides[1] == 1  # (channels last)
    Image.fromarray(np.full((8, 8), 77, np.uint8)).save(sources[3].path)  # grayscale: laid out anew
    assert readers.decode_images(sources, image_size=6, workers=2, view=True)[0].flags.c_contiguous


def test_spec_detection(mnist_dir, cifar_dir, image_folder, npz_file, tmp_path):
    assert parse_spec("digits") == ("digits", None)
    assert parse_spec(str(mnist_dir))[0] == "mnist"
    assert parse_spec(str(cifar_dir))[0] == "cifar10"
    assert parse_spec(str(image_folder))[0] == "imagefolder"
    assert parse_spec(str(npz_file))[0] == "npz"
    assert parse_spec(f"imagefolder:{image_folder}") == ("imagefolder", image_folder)
    with pytest.raises(GpuaccelError, match="unknown data kind 'bogus'"):
        parse_spec(f"bogus:{image_folder}")


def test_channel_stats_are_the_mean_and_deviation_of_the_pixels_as_floats():
    from gpuaccel.data.dataset import ImageDataset

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (30, 3, 8, 8), dtype=np.uint8)
    images[:, 1] = rng.integers(100, 110, (30, 8, 8), dtype=np.uint8)  # a narrow channel
    images[:, 2] = 7  # a constant one: its deviation is floored, not zero
    ds = ImageDataset("t", images, np.arange(30) % 2, images[:4], np.arange(4) % 2, ["a", "b"])
    mean, std = ds.channel_stats()
    pixels = images.astype(np.float64) / 255.0
    np.testing.assert_allclose(mean, pixels.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(std[:2], pixels.std(axis=(0, 2, 3))[:2], rtol=1e-12)
    assert std[2] == 1e-3


def test_a_fifo_or_device_named_like_an_image_is_named_not_waited_on(tmp_path, cache_dir):
    """A FIFO would block its reader for ever, /dev/zero never ends: each is one line, or with
    --skip-bad skipped and named, and never opened."""
    root = make_image_folder(tmp_path / "imgs", per_class=(6, 2), split=False)
    os.mkfifo(root / CLASSES[0] / "y.jpg")
    os.symlink("/dev/zero", root / CLASSES[1] / "z.png")
    with pytest.raises(GpuaccelError, match=r"cannot decode image .*(y\.jpg|z\.png) \((a FIFO|a device)"):
        load_dataset(str(root), cache_dir=cache_dir)
    data = load_dataset(str(root), cache_dir=cache_dir, skip_bad=True)
    assert sorted(os.path.basename(n) for n in data.skipped) == ["y.jpg", "z.png"]
    with pytest.raises(GpuaccelError, match=r"is a FIFO \(named pipe\), not a regular file"):
        parse_spec(str(root / CLASSES[0] / "y.jpg"))
