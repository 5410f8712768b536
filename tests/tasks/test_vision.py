"""Object detection and segmentation: the COCO, YOLO and mask readers, augmentation that moves
boxes and masks with the pixels, COCO mAP and mIoU on cases with known answers, and a detector
and a segmenter trained, exported and run on CPU-sized scenes."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from conftest import run

from gpuaccel.data.scene_loader import SceneAugment, SceneBatches, scene_tensors
from gpuaccel.data.scenes import load_scenes, scene_kind
from gpuaccel.errors import GpuaccelError
from gpuaccel.runtime.loaders import ResidentLoader
from gpuaccel.tasks.detection import (
    IOU_THRESHOLDS,
    Detection,
    box_iou,
    coco_map,
    match,
    nms_reference,
)
from gpuaccel.tasks.segmentation import Segmentation

CLASSES = ["square", "bar"]


def make_scenes(root, train=120, val=30, size=64, seed=0):
    """Bright squares (class 0) and dark wide bars (class 1) on noise, in all three layouts: COCO
    annotations, YOLO labels and masks (0 background, 1 square, 2 bar)."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("val", val)):
        for sub in ("images", "labels", "masks"):
            (root / sub / split).mkdir(parents=True, exist_ok=True)
        coco = {"images": [], "annotations": [], "categories": [{"id": 1, "name": "square"}, {"id": 2, "name": "bar"}]}
        for i in range(count):
            image = rng.integers(90, 160, (size, size, 3)).astype(np.uint8)
            mask = np.zeros((size, size), np.uint8)
            lines = []
            for _ in range(int(rng.integers(1, 3))):
                cls = int(rng.integers(0, 2))
                w, h = (int(rng.integers(12, 20)),) * 2 if cls == 0 else (int(rng.integers(20, 30)), 8)
                x, y = int(rng.integers(0, size - w)), int(rng.integers(0, size - h))
                if mask[y:y + h, x:x + w].any():
                    continue
                image[y:y + h, x:x + w] = 240 if cls == 0 else 20
                mask[y:y + h, x:x + w] = cls + 1
                coco["annotations"].append({"id": len(coco["annotations"]) + 1, "image_id": i + 1,
                                            "category_id": cls + 1, "bbox": [x, y, w, h], "area": w * h,
                                            "iscrowd": 0})
                lines.append(f"{cls} {(x + w / 2) / size} {(y + h / 2) / size} {w / size} {h / size}")
            name = f"{i:04d}"
            Image.fromarray(image).save(root / "images" / split / f"{name}.png")
            Image.fromarray(mask).save(root / "masks" / split / f"{name}.png")
            (root / "labels" / split / f"{name}.txt").write_text("\n".join(lines) + "\n")
            coco["images"].append({"id": i + 1, "file_name": f"{name}.png", "width": size, "height": size})
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    (root / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    return root


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    return make_scenes(tmp_path_factory.mktemp("scenes"))


# --- readers ----------------------------------------------------------------------------------------

def test_the_three_readers_agree_on_the_same_scenes(scenes):
    coco = load_scenes(scenes, "coco")
    yolo = load_scenes(scenes, "yolo")
    masks = load_scenes(scenes, "masks")
    assert coco.kind == yolo.kind == "detection" and masks.kind == "segmentation"
    assert coco.classes == yolo.classes == masks.classes == CLASSES
    assert (len(coco.train), len(coco.test)) == (120, 30) == (len(masks.train), len(masks.test))
    np.testing.assert_allclose(coco.train.boxes, yolo.train.boxes, atol=1e-3)
    assert (coco.train.labels == yolo.train.labels).all()
    # each box holds exactly its object's pixels in the mask
    for n in range(10):
        for (x0, y0, x1, y1), label in zip(coco.train.boxes[n], coco.train.labels[n]):
            if label >= 0:
                assert (masks.train.masks[n, int(y0):int(y1), int(x0):int(x1)] == label + 1).all()
    assert scene_kind(scenes) == "coco" and scene_kind(scenes, "segmentation") == "masks"


def test_a_second_read_comes_from_the_cache_whole(scenes, tmp_path, monkeypatch):
    import gpuaccel.data.scenes as readers

    first = load_scenes(scenes, "coco", cache_dir=tmp_path)
    masks = load_scenes(scenes, "masks", cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.npz"))) == 2
    monkeypatch.setattr(readers, "decode_images", lambda *a, **k: pytest.fail("decoded again"))
    again = load_scenes(scenes, "coco", cache_dir=tmp_path)
    for split in ("train", "test"):
        for field in ("images", "boxes", "labels"):
            assert np.array_equal(getattr(getattr(first, split), field), getattr(getattr(again, split), field))
        assert getattr(first, split).names == getattr(again, split).names
    assert (again.classes, again.kind, again.fingerprint) == (first.classes, first.kind, first.fingerprint)
    assert np.array_equal(load_scenes(scenes, "masks", cache_dir=tmp_path).train.masks, masks.train.masks)


def test_a_smaller_image_size_scales_the_boxes(scenes):
    full = load_scenes(scenes, "coco")
    half = load_scenes(scenes, "coco", image_size=32)
    assert half.train.images.shape[2:] == (32, 32)
    np.testing.assert_allclose(half.train.boxes, full.train.boxes / 2, atol=1e-4)


def test_bad_boxes_are_one_line_or_skipped_and_counted(tmp_path):
    root = make_scenes(tmp_path / "s", train=8, val=4)
    coco_file = root / "annotations" / "instances_train.json"
    coco = json.loads(coco_file.read_text())
    coco["annotations"][0]["bbox"] = [10, 10, 0, 5]  # no area
    coco["annotations"][1]["bbox"] = [50, 50, 40, 40]  # outside the 64x64 image
    coco_file.write_text(json.dumps(coco))
    with pytest.raises(GpuaccelError, match="has no area.*skip.bad"):
        load_scenes(root, "coco")
    data = load_scenes(root, "coco", skip_bad=True)
    assert len(data.skipped) == 2 and "outside" in data.skipped[1]
    (root / "labels" / "train" / "0000.txt").write_text("0 0.5 0.5 1.5 0.2\n")
    with pytest.raises(GpuaccelError, match="0000.txt line 1.*outside"):
        load_scenes(root, "yolo")
    (root / "labels" / "train" / "0000.txt").write_text("zero 0.5 0.5\n")
    with pytest.raises(GpuaccelError, match="is not 'class cx cy w h'"):
        load_scenes(root, "yolo")


def test_masks_of_another_size_and_missing_masks(tmp_path):
    root = make_scenes(tmp_path / "s", train=8, val=4)
    Image.fromarray(np.zeros((10, 10), np.uint8)).save(root / "masks" / "train" / "0001.png")
    (root / "masks" / "train" / "0002.png").unlink()
    with pytest.raises(GpuaccelError, match="has no mask"):
        load_scenes(root, "masks")
    (root / "images" / "train" / "0002.png").unlink()
    with pytest.raises(GpuaccelError, match="0001.png: it is 10x10, its image 64x64"):
        load_scenes(root, "masks")
    assert len(load_scenes(root, "masks", skip_bad=True).train) == 6


# --- augmentation -----------------------------------------------------------------------------------

def _loader(split, augment):
    cpu = torch.device("cpu")
    return ResidentLoader(scene_tensors(split, cpu), batch_size=len(split), device=cpu, train=True, seed=3,
                          transform=SceneBatches(mean=[0.5] * 3, std=[0.25] * 3, device=cpu, augment=augment))


def test_zoomed_and_flipped_boxes_stay_on_their_objects(scenes):
    data = load_scenes(scenes, "coco")
    images, (boxes, labels) = next(iter(_loader(data.train, SceneAugment(flip=True, zoom=0.4)).batches(0)))
    moved = 0
    for n in range(len(images)):
        bright = images[n].mean(0)  # squares are bright, bars dark
        for (x0, y0, x1, y1), label in zip(boxes[n], labels[n]):
            if label < 0:
                continue
            inside = bright[int(y0) + 1:int(y1) - 1, int(x0) + 1:int(x1) - 1]
            assert (inside > 1.5).float().mean() > 0.9 if label == 0 else (inside < -1.5).float().mean() > 0.9
            moved += 1
    assert moved > 100
    assert not torch.equal(boxes, torch.from_numpy(data.train.boxes)[_loader(data.train, None).order.epoch_indices(0)])


def test_zoomed_masks_move_with_the_pixels(scenes):
    data = load_scenes(scenes, "masks")
    images, masks = next(iter(_loader(data.train, SceneAugment(flip=True, zoom=0.4)).batches(0)))
    brightness = images.mean(1)
    for cls, looks_right in ((1, lambda v: v > 1.5), (2, lambda v: v < -1.5)):
        # away from the edges, which resampling blurs: every masked pixel shows its object
        interior = torch.nn.functional.max_pool2d((masks != cls).float()[:, None], 3, 1, 1)[:, 0] == 0
        assert interior.sum() > 5000 and looks_right(brightness[interior]).float().mean() > 0.99


# --- metrics ----------------------------------------------------------------------------------------

def _map(dets, gts, classes=1):
    """dets: per image [(x0, y0, x1, y1, score, class)], gts: per image [(x0, y0, x1, y1, class)]."""
    k, m = max(len(d) for d in dets), max(len(g) for g in gts)
    boxes, scores, cls = torch.zeros(len(dets), k, 4), torch.zeros(len(dets), k), torch.full((len(dets), k), -1)
    gt_boxes, gt_labels = torch.zeros(len(gts), m, 4), torch.full((len(gts), m), -1)
    for n, rows in enumerate(dets):
        for j, r in enumerate(rows):
            boxes[n, j], scores[n, j], cls[n, j] = torch.tensor(r[:4]), r[4], r[5]
    for n, rows in enumerate(gts):
        for j, r in enumerate(rows):
            gt_boxes[n, j], gt_labels[n, j] = torch.tensor(r[:4]), r[4]
    tp = match(boxes, scores, cls, gt_boxes, gt_labels, torch.tensor(IOU_THRESHOLDS))
    keep = cls.flatten() >= 0
    return coco_map(scores.flatten()[keep], cls.flatten()[keep], tp.permute(1, 0, 2).flatten(1)[:, keep],
                    torch.bincount(gt_labels[gt_labels >= 0], minlength=classes), classes)


def test_map_on_known_cases():
    exact = _map([[(0, 0, 10, 10, 0.9, 0)]], [[(0, 0, 10, 10, 0)]])
    assert exact == {"map": 1.0, "map50": 1.0, "map75": 1.0}
    # IoU 0.58: a hit at thresholds 0.50 and 0.55 only, 2 of 10
    assert _map([[(0, 0, 10, 5.8, 0.9, 0)]], [[(0, 0, 10, 10, 0)]]) == pytest.approx(
        {"map": 0.2, "map50": 1.0, "map75": 0.0})
    # a false positive ranked first: precision 1/2 at full recall
    assert _map([[(50, 50, 60, 60, 0.9, 0), (0, 0, 10, 10, 0.8, 0)]], [[(0, 0, 10, 10, 0)]])["map50"] == 0.5
    # the right box with the wrong class finds nothing; two detections of one object: one is a false positive
    assert _map([[(0, 0, 10, 10, 0.9, 1)]], [[(0, 0, 10, 10, 0)]], classes=2)["map"] == 0.0
    # one of two objects found, best first: recall reaches 1/2, so AP is 51/101
    assert _map([[(0, 0, 10, 10, 0.9, 0)]], [[(0, 0, 10, 10, 0), (20, 20, 30, 30, 0)]])["map50"] == \
        pytest.approx(51 / 101)


def test_map_equals_pycocotools():
    pycocotools = pytest.importorskip("pycocotools.cocoeval")
    import contextlib
    import io

    from pycocotools.coco import COCO

    g = torch.Generator().manual_seed(0)
    gts, dets, images, anns = [], [], [], []
    for n in range(30):
        rows = []
        for _ in range(int(torch.randint(1, 5, (1,), generator=g))):
            x, y = (torch.rand(2, generator=g) * 70).tolist()
            w, h = (torch.rand(2, generator=g) * 25 + 5).tolist()
            rows.append((x, y, x + w, y + h, int(torch.randint(0, 3, (1,), generator=g))))
            anns.append({"id": len(anns) + 1, "image_id": n + 1, "category_id": rows[-1][4] + 1, "bbox": [x, y, w, h],
                         "area": w * h, "iscrowd": 0})
        gts.append(rows)
        found = [(r[0] + float(torch.randn((), generator=g)) * 2, r[1], r[2], r[3], float(torch.rand((), generator=g)),
                  r[4] if torch.rand((), generator=g) < 0.8 else 0) for r in rows]
        found += [(float(a), float(b), float(a) + 9, float(b) + 12, float(s), int(c)) for a, b, s, c in zip(
            torch.rand(5, generator=g) * 80, torch.rand(5, generator=g) * 80, torch.rand(5, generator=g),
            torch.randint(0, 3, (5,), generator=g))]
        dets.append(found)
        images.append({"id": n + 1, "width": 100, "height": 100})
    coco = COCO()
    coco.dataset = {"images": images, "annotations": anns, "categories": [{"id": c + 1} for c in range(3)]}
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
        results = coco.loadRes([{"image_id": n + 1, "category_id": d[5] + 1, "bbox": [d[0], d[1], d[2] - d[0],
                                 d[3] - d[1]], "score": d[4]} for n, found in enumerate(dets) for d in found])
        evaluation = pycocotools.COCOeval(coco, results, "bbox")
        evaluation.evaluate(), evaluation.accumulate(), evaluation.summarize()
    ours = _map(dets, gts, classes=3)
    assert [ours["map"], ours["map50"], ours["map75"]] == pytest.approx(list(evaluation.stats[:3]), abs=1e-6)


def _gathered_map(rank, world, path, dets, gts):
    torch.distributed.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    task = Detection(2, top_k=4)
    counts = task.metrics()["map"].counts
    counts.reset()
    outputs = torch.zeros(len(dets[0]), 6, 4, 4)  # (not read: decoding is replaced by the detections)
    boxes, scores, classes = dets
    task.decode = lambda _: (boxes[rank::world], scores[rank::world], classes[rank::world])
    counts.add(outputs[rank::world], (gts[0][rank::world], gts[1][rank::world]))
    result = counts.result()
    torch.distributed.destroy_process_group()
    torch.save(result, f"{path}.{rank}")


def test_processes_gather_their_detections_for_one_map(tmp_path):
    g = torch.Generator().manual_seed(1)
    gt_boxes = torch.rand(8, 3, 2, generator=g).mul(40).repeat(1, 1, 2) + torch.tensor([0., 0, 12, 12])
    gt_labels = torch.randint(0, 2, (8, 3), generator=g)
    boxes = gt_boxes[:, [0, 1, 2, 0]] + torch.randn(8, 4, 4, generator=g)
    scores, classes = torch.rand(8, 4, generator=g), torch.cat([gt_labels, torch.zeros(8, 1, dtype=torch.long)], 1)
    dets = (boxes, scores, classes)
    torch.multiprocessing.spawn(_gathered_map, args=(2, tmp_path / "group", dets, (gt_boxes, gt_labels)), nprocs=2)
    single = Detection(2, top_k=4)
    single.decode = lambda _: dets
    single._counts.add(torch.zeros(8, 6, 4, 4), (gt_boxes, gt_labels))
    expected = single._counts.result()
    assert 0 < expected["map50"] < 1
    for rank in range(2):
        assert torch.load(f"{tmp_path / 'group'}.{rank}") == pytest.approx(expected)


def test_nms_and_iou():
    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10], [30, 30, 40, 40.]])
    assert box_iou(boxes[:1], boxes[1:2]).item() == pytest.approx(81 / 119)
    kept = nms_reference(boxes, torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([0, 0, 1, 0]), 0.5)
    assert kept.tolist() == [0, 2, 3]  # the second overlaps the first, of its class; the third is another class


def test_detections_of_many_images_suppressed_at_once_are_each_images_own():
    from gpuaccel.deploy.vision import kept_detections

    g = torch.Generator().manual_seed(0)
    n, k = 300, 40
    centres = torch.rand(n, 4, 2, generator=g) * 100  # a few clusters per image: many overlaps
    xy = centres[torch.arange(n)[:, None], torch.randint(0, 4, (n, k), generator=g)] + torch.randn(n, k, 2, generator=g)
    size = 8 + 4 * torch.rand(n, k, 2, generator=g)
    scores = torch.rand(n, k, generator=g).sort(1, descending=True).values  # (decode's order: best first)
    classes = torch.randint(0, 3, (n, k), generator=g).float()
    decoded = torch.cat([xy, xy + size, scores[..., None], classes[..., None]], -1).numpy()
    decoded[7, :, 4] = 0.0  # an image with nothing above the score
    kept = kept_detections(decoded, score=0.3, iou=0.5, images_at_once=64)
    assert len(kept) == n and kept[7].shape == (0, 6)
    for rows, got in zip(decoded, kept):
        rows = rows[rows[:, 4] >= 0.3]
        t = torch.from_numpy(rows)
        expected = rows[nms_reference(t[:, :4], t[:, 4], t[:, 5].long(), 0.5).numpy()]
        np.testing.assert_array_equal(got, expected)
    assert sum(map(len, kept)) < (decoded[..., 4] >= 0.3).sum()  # (something was suppressed)


def test_miou_and_pixel_accuracy_on_a_known_case():
    truth = torch.tensor([[[0, 0, 1, 1], [0, 0, 2, 255]]])
    predicted = torch.tensor([[[0, 1, 1, 1], [0, 0, 0, 2]]])
    logits = torch.nn.functional.one_hot(predicted, 3).permute(0, 3, 1, 2).float()
    task = Segmentation(3)
    sums = {name: m.sums(logits, truth) for name, m in task.metrics().items()}
    # background 3 of 5 (3 right, 1 predicted 1, 1 predicted 0 for 2), class 1: 2 of 3, class 2: 0 of 1
    assert task.metrics()["miou"].finish(sums["miou"].tolist()) == pytest.approx((3 / 5 + 2 / 3 + 0) / 3)
    assert task.metrics()["pixel_accuracy"].finish(sums["pixel_accuracy"].tolist()) == pytest.approx(5 / 7)
    assert torch.isfinite(task.loss(logits * 5, truth))


def test_the_segmentation_loss_traces_whole_and_the_trainer_compiles_it(scenes):
    from gpuaccel.train.config import TrainConfig
    from gpuaccel.train.trainer import Trainer

    task = Segmentation(4)
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 6, 6, requires_grad=True)
    masks = torch.randint(0, 4, (2, 6, 6))
    masks[0, 0] = 255  # (not scored)
    eager = task.loss(logits, masks)
    grad, = torch.autograd.grad(eager, logits)
    traced = torch.compile(task.loss, backend="aot_eager", fullgraph=True, dynamic=False)(logits, masks)  # one graph
    assert torch.allclose(traced, eager) and torch.allclose(torch.autograd.grad(traced, logits)[0], grad, atol=1e-6)
    trainer = Trainer(TrainConfig(data=str(scenes), task="segmentation", model="unet", model_args={"width": 4, "levels": 2},
                                  epochs=1, batch_size=8, run_dir=None, monitor=False, compile=True), quiet=True)
    assert trainer.loss_fn is not trainer.task.loss  # (compiled beside the model)


def test_segmentation_tta_averages_the_mirror_images_logits_mirrored_back(scenes):
    from gpuaccel.train.config import TrainConfig
    from gpuaccel.train.trainer import Trainer

    torch.manual_seed(0)
    images = torch.randn(2, 3, 5, 7)
    lopsided = torch.nn.Conv2d(3, 4, (1, 3), padding=(0, 1))  # (its output changes when the input is mirrored)
    plain, tta = Segmentation(4).eval_outputs(lopsided, images), Segmentation(4, tta=1).eval_outputs(lopsided, images)
    assert torch.equal(plain, lopsided(images))
    assert torch.allclose(tta, (lopsided(images) + lopsided(images.flip(-1)).flip(-1)) / 2)
    assert not torch.allclose(tta, plain)
    symmetric = torch.nn.Conv2d(3, 4, 1)  # (mirroring commutes with it: the average is the plain output)
    assert torch.allclose(Segmentation(4, tta=1).eval_outputs(symmetric, images), symmetric(images), atol=1e-6)
    assert Segmentation(4, tta=1).describe()["tta"] == 1  # (recorded, so a resumed run evaluates the same way)
    with pytest.raises(GpuaccelError, match="segmentation's (--)?tta is 0"):
        Segmentation(4, tta=2)
    common = dict(data=str(scenes), model_args={"width": 4, "levels": 2}, epochs=1, batch_size=8, run_dir=None,
                  monitor=False, tta=1)
    trainer = Trainer(TrainConfig(task="segmentation", model="unet", **common), quiet=True)
    assert trainer.task.tta == 1
    with pytest.raises(GpuaccelError, match="(--)?tta averages"):
        Trainer(TrainConfig(model="centernet", **{**common, "model_args": None}), quiet=True)


# --- train, export, infer ---------------------------------------------------------------------------

def _gpuaccel(capsys, *args) -> str:
    """A gpuaccel command in this process (a process of its own would add seconds of imports);
    its output."""
    code, out, err = run(capsys, *map(str, args))
    assert code == 0, err[-3000:]
    return out


def test_a_detector_learns_exports_and_infers(scenes, tmp_path, capsys, monkeypatch):
    _gpuaccel(capsys, "train", "--data", scenes, "--model", "centernet", "--model-args", "width=8,channels=32",
              "--epochs", 14, "--batch-size", 16, "--optimizer", "adamw", "--lr", "3e-3", "--schedule", "onecycle",
              "--flip", "random", "--eval-every", 14, "--target", "map50=0.3", "--run-dir", tmp_path / "run",
              "--no-monitor", "--quiet")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"]["map50"] >= 0.3, summary["metrics"]  # chance is about 0
    assert summary["stopped_by"] == "target"
    export = _gpuaccel(capsys, "export", tmp_path / "run", "--format", "onnx")
    assert "boxes within" in export
    _gpuaccel(capsys, "infer", tmp_path / "run" / "model.onnx", scenes / "images" / "val", "--out",
              tmp_path / "boxes.csv", "--overlay", tmp_path / "overlays")
    lines = (tmp_path / "boxes.csv").read_text().splitlines()
    assert lines[0] == "image,class,score,x,y,w,h" and len(lines) > 20
    assert {line.split(",")[1] for line in lines[1:]} <= set(CLASSES)
    assert len(list((tmp_path / "overlays").glob("*.png"))) == 30
    # in chunks decoded by a pool of processes into shared memory, read from there as it is: the same boxes
    from gpuaccel.deploy import infer

    monkeypatch.setattr(infer, "CHUNK", 16)
    _gpuaccel(capsys, "infer", tmp_path / "run" / "model.onnx", scenes / "images" / "val", "--out",
              tmp_path / "chunked.csv")
    assert (tmp_path / "chunked.csv").read_text().splitlines() == lines


def test_a_segmenter_learns_exports_and_writes_masks(scenes, tmp_path, capsys):
    _gpuaccel(capsys, "train", "--data", scenes, "--task", "segmentation", "--model", "unet", "--model-args",
              "width=8,levels=3", "--epochs", 6, "--batch-size", 16, "--optimizer", "adamw", "--lr", "3e-3",
              "--eval-every", 1000, "--run-dir", tmp_path / "run", "--no-monitor", "--quiet")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["metrics"]["miou"] > 0.6, summary["metrics"]  # all background scores about 0.3
    export = _gpuaccel(capsys, "export", tmp_path / "run", "--format", "onnx")
    assert "class maps agree" in export
    _gpuaccel(capsys, "infer", tmp_path / "run" / "model.onnx", scenes / "images" / "val" / "0003.png", "--out",
              tmp_path / "masks")
    mask = np.asarray(Image.open(tmp_path / "masks" / "0003.png"))
    truth = np.asarray(Image.open(scenes / "masks" / "val" / "0003.png"))
    assert mask.shape == truth.shape and (mask == truth).mean() > 0.9


def test_a_detection_task_refuses_a_classifier_before_training(scenes):
    from gpuaccel.train.config import TrainConfig
    from gpuaccel.train.trainer import Trainer

    trainer = Trainer(TrainConfig(data=str(scenes), model="lenet5", epochs=1, batch_size=8, run_dir=None,
                                  monitor=False), quiet=True)
    with pytest.raises(GpuaccelError, match="task detection takes maps of 2 class heat maps"):
        trainer.fit()
    assert isinstance(trainer.task, Detection)


def test_a_coco_image_listed_twice_or_an_annotation_of_no_listed_image_is_named(tmp_path):
    root = make_scenes(tmp_path / "s", train=8, val=4)
    coco_file = root / "annotations" / "instances_train.json"
    coco = json.loads(coco_file.read_text())
    twice = dict(coco, images=coco["images"] + [dict(coco["images"][2], id=99)])  # the same file, another id
    coco_file.write_text(json.dumps(twice))
    with pytest.raises(GpuaccelError, match=r"lists 0002.png \(ids 3 and 99\) twice"):
        load_scenes(root, "coco")
    orphan = dict(coco, annotations=coco["annotations"] + [dict(coco["annotations"][0], id=500, image_id=77)])
    coco_file.write_text(json.dumps(orphan))
    with pytest.raises(GpuaccelError, match="annotation 500 is of image id 77, which the file does not list"):
        load_scenes(root, "coco")
    data = load_scenes(root, "coco", skip_bad=True)
    assert any("image id 77" in s for s in data.skipped)


def test_a_sixteen_bit_mask_beyond_255_is_refused_not_wrapped(tmp_path):
    root = make_scenes(tmp_path / "s", train=8, val=4)
    mask = np.zeros((64, 64), np.uint16)
    mask[5:20, 5:20] = 260  # would wrap to class 4 as uint8
    Image.fromarray(mask).save(root / "masks" / "train" / "0003.png")
    with pytest.raises(GpuaccelError, match=r"mask masks/train/0003.png: it holds class value 260"):
        load_scenes(root, "masks")


def test_a_detector_that_finds_nothing_is_verified_on_all_its_boxes_not_on_none():
    """An export check on images where the model finds no box used to compare nothing and pass:
    every top-k box is compared then, so an artefact with other boxes fails."""
    from gpuaccel.deploy.vision import compare_detections

    rng = np.random.default_rng(0)
    expected = np.concatenate([rng.uniform(0, 60, (2, 5, 4)), np.full((2, 5, 1), 0.01), np.zeros((2, 5, 1))], -1)
    same = compare_detections(expected, expected.copy())
    assert same["passed"] and same["detections_compared"] == 10 and same["compared_at_score"] is None
    moved = expected.copy()
    moved[..., :4] += 3.0  # other boxes, still below any score threshold
    assert not compare_detections(expected, moved)["passed"]
