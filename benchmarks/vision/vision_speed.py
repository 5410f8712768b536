"""Detection and segmentation on digit scenes: gpuaccel's recipes against the loops users write
today, side by side on one GPU, each part written to its own JSON file under --out.

    python benchmarks/vision/vision_speed.py --data /tmp/scenes --out DIR \\
        --parts frcnn unet detect segment infer --seeds 0 1 2 --anchor-seconds 150

Data: ``../shared/data/scenes/make_digit_scenes.py /tmp/scenes`` (8,000 train + 1,000 val
images, 128x128, COCO annotations and PNG masks).

frcnn    torchvision's fasterrcnn_mobilenet_v3_large_fpn (weights=None, min/max size 128), a
         textbook loop: a Dataset reading the JPEG and the COCO boxes with Pillow, random flips,
         DataLoader with 8 workers, SGD (lr 0.02, momentum 0.9, weight decay 1e-4, linear
         warm-up), fp16 autocast with a GradScaler, for --anchor-seconds of training; mAP on
         val after every epoch (evaluation not timed).
fcos     the same loop with fcos_resnet50_fpn (lr 0.01).
unet     a plain U-Net (4 levels, 32 channels at the top, batch norm), fp32, the same kind of
         Dataset reading JPEG + PNG mask, Adam 1e-3, cross-entropy, for --anchor-seconds; mIoU
         on val after every epoch.
detect   gpuaccel train --recipe scenes-detect, for each seed.
segment  gpuaccel train --recipe scenes-segment, for each seed.
infer    the trained detector and segmenter (the first seed of `detect` and `segment`) exported
         to ONNX and verified; the detector's frames/s at batch 32 and batch-1 latency in PyTorch
         on the GPU (bf16, decoding included) and in ONNX Runtime (CPU provider).

Every mAP is gpuaccel.tasks.detection's COCO evaluation (matching pycocotools to 1e-7 on the
test in tests/tasks/test_vision.py) and every mIoU its confusion matrix, so the numbers compare.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from gpuaccel.tasks.detection import IOU_THRESHOLDS, coco_map, match
from gpuaccel.tasks.segmentation import ConfusionMatrix


def environment() -> dict:
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}


# --- the users' side: Datasets and loops as written from the torchvision docs ---------------------

class CocoScenes(torch.utils.data.Dataset):
    def __init__(self, root: Path, split: str, train: bool):
        data = json.loads((root / "annotations" / f"instances_{split}.json").read_text())
        self.root, self.train = root, train
        self.images = data["images"]
        self.objects = {i["id"]: [] for i in self.images}
        for a in data["annotations"]:
            self.objects[a["image_id"]].append(a)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, k):
        import torchvision.transforms.functional as TF
        from PIL import Image

        info = self.images[k]
        image = TF.to_tensor(Image.open(self.root / "images" / info["file_name"]).convert("RGB"))
        objs = self.objects[info["id"]]
        boxes = torch.tensor([[o["bbox"][0], o["bbox"][1], o["bbox"][0] + o["bbox"][2], o["bbox"][1] + o["bbox"][3]]
                              for o in objs], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor([o["category_id"] for o in objs], dtype=torch.int64)  # 1..10, 0 background
        if self.train and torch.rand(()) < 0.5:
            image = image.flip(-1)
            boxes = torch.stack([image.shape[-1] - boxes[:, 2], boxes[:, 1], image.shape[-1] - boxes[:, 0],
                                 boxes[:, 3]], 1)
        return image, {"boxes": boxes, "labels": labels}


class MaskScenes(torch.utils.data.Dataset):
    def __init__(self, root: Path, split: str, train: bool):
        self.root, self.split, self.train = root, split, train
        self.names = sorted(p.stem for p in (root / "images" / split).glob("*.jpg"))

    def __len__(self):
        return len(self.names)

    def __getitem__(self, k):
        import torchvision.transforms.functional as TF
        from PIL import Image

        name = self.names[k]
        image = TF.to_tensor(Image.open(self.root / "images" / self.split / f"{name}.jpg").convert("RGB"))
        mask = torch.from_numpy(np.array(Image.open(self.root / "masks" / self.split / f"{name}.png"))).long()
        if self.train and torch.rand(()) < 0.5:
            image, mask = image.flip(-1), mask.flip(-1)
        return image, mask


def collate_detection(batch):
    return [b[0] for b in batch], [b[1] for b in batch]


def detections_map(model, loader, device, num_classes: int = 10) -> dict:
    """COCO mAP of a torchvision detector over ``loader`` (gpuaccel's evaluation)."""
    model.eval()
    parts, counts = [], torch.zeros(num_classes, dtype=torch.long)
    with torch.no_grad():
        for images, targets in loader:
            outputs = model([i.to(device) for i in images])
            n, k = len(outputs), 100
            boxes, scores = torch.zeros(n, k, 4), torch.zeros(n, k)
            classes = torch.full((n, k), -1, dtype=torch.long)
            m = max(len(t["labels"]) for t in targets) or 1
            gt_boxes, gt_labels = torch.zeros(n, m, 4), torch.full((n, m), -1, dtype=torch.long)
            for i, (out, t) in enumerate(zip(outputs, targets)):
                d = min(k, len(out["scores"]))
                boxes[i, :d], scores[i, :d], classes[i, :d] = out["boxes"][:d].cpu(), out["scores"][:d].cpu(), \
                    out["labels"][:d].cpu() - 1
                g = len(t["labels"])
                gt_boxes[i, :g], gt_labels[i, :g] = t["boxes"], t["labels"] - 1
            tp = match(boxes, scores, classes, gt_boxes, gt_labels, torch.tensor(IOU_THRESHOLDS))
            keep = classes.flatten() >= 0
            parts.append((scores.flatten()[keep], classes.flatten()[keep], tp.permute(1, 0, 2).flatten(1)[:, keep]))
            counts += torch.bincount(gt_labels[gt_labels >= 0], minlength=num_classes)
    model.train()
    scores, classes, tp = (torch.cat(p, -1) for p in zip(*parts))
    return coco_map(scores, classes, tp, counts, num_classes)


def train_for(seconds: float, epoch_fn, evaluate_fn) -> list[dict]:
    """Epochs until ``seconds`` of training have passed; each epoch's time (evaluation excluded)
    and metrics."""
    curve, trained = [], 0.0
    while trained < seconds:
        torch.cuda.synchronize()
        start = time.perf_counter()
        epoch_fn()
        torch.cuda.synchronize()
        trained += time.perf_counter() - start
        curve.append({"train_seconds": round(trained, 2), **{k: round(v, 5) for k, v in evaluate_fn().items()}})
        print(curve[-1], flush=True)
    return curve


def time_to_final(curve: list[dict], metric: str) -> dict:
    final = curve[-1][metric]
    first = next(c for c in curve if c[metric] >= final)
    return {"final": final, "best": max(c[metric] for c in curve), "seconds_to_final": first["train_seconds"],
            "epochs": len(curve)}


def torchvision_detector(name: str, root: Path, seconds: float, lr: float) -> dict:
    import torchvision

    device = torch.device("cuda")
    factory = getattr(torchvision.models.detection, name)
    model = factory(weights=None, weights_backbone=None, num_classes=11, min_size=128, max_size=128).to(device)
    train = torch.utils.data.DataLoader(CocoScenes(root, "train", True), batch_size=32, shuffle=True, num_workers=8,
                                        collate_fn=collate_detection, drop_last=True, persistent_workers=True)
    val = torch.utils.data.DataLoader(CocoScenes(root, "val", False), batch_size=64, num_workers=8,
                                      collate_fn=collate_detection)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.001, total_iters=500)
    scaler = torch.amp.GradScaler()

    def epoch():
        for images, targets in train:
            images = [i.to(device, non_blocking=True) for i in images]
            targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()} for t in targets]
            with torch.autocast("cuda", dtype=torch.float16):
                losses = model(images, targets)
                loss = sum(losses.values())
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            warmup.step()

    model.train()
    curve = train_for(seconds, epoch, lambda: detections_map(model, val, device))
    return {"model": name, "curve": curve, **time_to_final(curve, "map"),
            "parameters": sum(p.numel() for p in model.parameters())}


class UNet(nn.Module):
    def __init__(self, classes: int = 11, width: int = 32, levels: int = 4):
        super().__init__()

        def block(i, o):
            return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                                 nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(inplace=True))

        widths = [width * 2 ** k for k in range(levels + 1)]
        self.down = nn.ModuleList([block(3, widths[0])] + [block(widths[k], widths[k + 1]) for k in range(levels)])
        self.up = nn.ModuleList(nn.ConvTranspose2d(widths[k + 1], widths[k], 2, stride=2) for k in range(levels))
        self.merge = nn.ModuleList(block(2 * widths[k], widths[k]) for k in range(levels))
        self.out = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = []
        for k, down in enumerate(self.down):
            x = down(x if k == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for k in reversed(range(len(self.up))):
            x = self.merge[k](torch.cat([skips[k], self.up[k](x)], 1))
        return self.out(x)


def unet(root: Path, seconds: float) -> dict:
    device = torch.device("cuda")
    model = UNet().to(device)
    train = torch.utils.data.DataLoader(MaskScenes(root, "train", True), batch_size=32, shuffle=True, num_workers=8,
                                        drop_last=True, persistent_workers=True)
    val = torch.utils.data.DataLoader(MaskScenes(root, "val", False), batch_size=64, num_workers=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def epoch():
        for images, masks in train:
            loss = F.cross_entropy(model(images.to(device)), masks.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def evaluate():
        model.eval()
        miou, accuracy = ConfusionMatrix(11, "miou"), ConfusionMatrix(11, "pixel_accuracy")
        totals = None
        with torch.no_grad():
            for images, masks in val:
                part = miou.sums(model(images.to(device)), masks.to(device))
                totals = part if totals is None else totals + part
        model.train()
        flat = totals.tolist()
        return {"miou": miou.finish(flat), "pixel_accuracy": accuracy.finish(flat)}

    curve = train_for(seconds, epoch, evaluate)
    return {"model": "unet (4 levels, 32 wide)", "curve": curve, **time_to_final(curve, "miou"),
            "parameters": sum(p.numel() for p in model.parameters())}


# --- gpuaccel -----------------------------------------------------------------------------------

def recipe_runs(recipe: str, root: Path, seeds: list[int], runs: Path, metric: str, changes: dict) -> dict:
    from gpuaccel.train.config import TrainConfig
    from gpuaccel.train.recipes import load_recipe
    from gpuaccel.train.trainer import Trainer

    results = []
    for seed in seeds:
        settings = {**load_recipe(recipe), **changes}  # (a shorter run: the schedule follows the epochs)
        run_dir = runs / f"{recipe}-{seed}"
        shutil.rmtree(run_dir, ignore_errors=True)  # (an earlier command's run there would be refused)
        config = TrainConfig(**{**settings, "data": str(root), "seed": seed, "run_dir": str(run_dir),
                                "monitor": False, "compile_background": False})  # (compiled, on a cold cache too)
        trainer = Trainer(config, quiet=True)
        summary = trainer.fit()
        results.append({"seed": seed, "train_seconds": summary["train_seconds"],
                        "warmup_seconds": round(trainer.times.warmup_seconds, 2), **summary["metrics"],
                        "samples_per_second": summary.get("samples_per_second"), "run_dir": str(trainer.run_dir)})
        print(results[-1], flush=True)
    return {"recipe": recipe, "changed": changes, "epochs": config.loop.epochs, "runs": results,
            "mean": {k: round(statistics.mean(r[k] for r in results), 5) for k in (metric, "train_seconds")}}


def inference(runs: Path) -> dict:
    """The trained detector and segmenter exported to ONNX (verified on 1,000 held-out images), and
    the detector's frames/s at batch 32 and batch-1 latency: PyTorch on the GPU (bf16, decoding
    included) and the ONNX artefact in ONNX Runtime on the CPU."""
    from gpuaccel.deploy.artifact import load_trained
    from gpuaccel.deploy.exports import export_run

    result = {}
    for name in ("scenes-detect-0", "scenes-segment-0"):
        report, _ = export_run(runs / name, "onnx")
        result[f"export_{name}"] = report
    trained = load_trained(runs / "scenes-detect-0")
    model = trained.task.deployed(trained.module).cuda().eval()
    images = torch.rand(32, 3, 128, 128)  # (the artefact takes [0, 1] pixels)

    def timed(call, x, repeats=50):
        for _ in range(10):
            call(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call(x)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        return {"median_ms": round(median * 1e3, 3), "frames_per_second": round(len(x) / median, 1)}

    def pytorch(x):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(x).cpu()  # (the host copy waits for the GPU)

    import onnxruntime

    session = onnxruntime.InferenceSession(str(runs / "scenes-detect-0" / "model.onnx"),
                                           providers=["CPUExecutionProvider"])
    for batch in (32, 1):
        result[f"pytorch_gpu_batch{batch}"] = timed(pytorch, images[:batch].cuda())
        result[f"onnxruntime_cpu_batch{batch}"] = timed(lambda x: session.run(None, {"x": x}), images[:batch].numpy(),
                                                         repeats=20)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--parts", nargs="+", default=["frcnn", "unet", "detect", "segment"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--anchor-seconds", type=float, default=150)
    p.add_argument("--recipe-epochs", type=float, help="train the recipes for this many epochs (default: the recipe's)")
    p.add_argument("--recipe-set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="change recipe settings for a trial, e.g. batch_size=128 lr=3e-3 (YAML values)")
    a = p.parse_args()
    changes = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in a.recipe_set)}
    if a.recipe_epochs is not None:
        changes["epochs"] = a.recipe_epochs
    a.out.mkdir(parents=True, exist_ok=True)
    runs = Path(os.environ.get("TMPDIR", "/tmp")) / "vision-runs"
    for part in a.parts:
        start = time.perf_counter()
        if part == "frcnn":
            result = torchvision_detector("fasterrcnn_mobilenet_v3_large_fpn", a.data, a.anchor_seconds, 0.02)
        elif part == "fcos":
            result = torchvision_detector("fcos_resnet50_fpn", a.data, a.anchor_seconds, 0.01)
        elif part == "unet":
            result = unet(a.data, a.anchor_seconds)
        elif part == "detect":
            result = recipe_runs("scenes-detect", a.data, a.seeds, runs, "map", changes)
        elif part == "segment":
            result = recipe_runs("scenes-segment", a.data, a.seeds, runs, "miou", changes)
        elif part == "infer":
            result = inference(runs)
        else:
            raise SystemExit(f"unknown part {part}")
        result = {**environment(), "part": part, "wall_seconds": round(time.perf_counter() - start, 1), **result}
        (a.out / f"{part}.json").write_text(json.dumps(result, indent=1))
        print(part, "done", flush=True)


if __name__ == "__main__":
    main()
