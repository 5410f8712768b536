"""Object detection: a one-stage, anchor-free detector in the CenterNet form (Zhou et al., 2019,
"Objects as Points").

The model returns one map (N, K + 4, H / stride, W / stride): per class a heat map whose peaks
are object centres, then each position's sub-cell offset of the centre (2) and the box's width
and height in cells (2). Training targets are made on the device from the padded boxes (an
elliptical Gaussian per object, its peak 1 at the centre cell), so a step does the same work
whatever the object counts and is captured whole as a CUDA graph. The loss is the penalty-reduced
focal loss on the heat maps plus L1 on offsets and sizes at the centres (sizes weighted 0.1).

Decoding keeps the peaks of the heat maps (a cell that is the maximum of its 3x3 neighbourhood:
the detector's non-maximum suppression, a max-pool on the GPU) and the ``top_k`` best of them,
as fixed-size (N, top_k) tensors; an export carries it. ``nms`` (class-wise box suppression,
torchvision.ops where present) thins what inference reports.

Metrics are COCO's: ``map`` (AP averaged over IoU 0.50:0.05:0.95), ``map50`` and ``map75``, with
COCO's greedy matching (each detection, best score first, takes the unmatched ground-truth box
of its class it overlaps most) and 101-point interpolated precision, over at most 100 detections
per image. Matching runs on the device per batch; the curves are read once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import GpuaccelError
from .base import Metric, Task

IOU_THRESHOLDS = tuple(round(0.5 + 0.05 * k, 2) for k in range(10))
RECALL_POINTS = 101


# --- boxes ----------------------------------------------------------------------------------------

def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of every box in ``a`` (..., P, 4) with every box in ``b`` (..., Q, 4), x0 y0 x1 y1:
    (..., P, Q)."""
    area = lambda t: (t[..., 2] - t[..., 0]).clamp_min(0) * (t[..., 3] - t[..., 1]).clamp_min(0)
    top_left = torch.maximum(a[..., :, None, :2], b[..., None, :, :2])
    bottom_right = torch.minimum(a[..., :, None, 2:], b[..., None, :, 2:])
    inter = (bottom_right - top_left).clamp_min(0).prod(-1)
    return inter / (area(a)[..., :, None] + area(b)[..., None, :] - inter).clamp_min(1e-9)


def nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, iou: float = 0.5) -> torch.Tensor:
    """Indices of the boxes (P, 4) kept by class-wise non-maximum suppression, best score first:
    torchvision.ops.batched_nms where torchvision is installed, else the same rule in torch."""
    try:
        from torchvision.ops import batched_nms
    except (ImportError, RuntimeError):  # (a torchvision that does not match torch fails at import)
        return nms_reference(boxes, scores, classes, iou)
    return batched_nms(boxes.float(), scores.float(), classes, iou)


def nms_reference(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, iou: float = 0.5) -> torch.Tensor:
    """Greedy class-wise NMS: best box first; a box is dropped when it overlaps a kept box of its
    class by more than ``iou``."""
    order = scores.argsort(descending=True, stable=True)
    boxes, classes = boxes[order].float(), classes[order]
    overlaps = box_iou(boxes, boxes) > iou
    overlaps &= classes[:, None] == classes[None, :]
    keep = torch.ones(len(order), dtype=torch.bool, device=boxes.device)
    for k in range(len(order)):  # (a host loop: inference post-processing, not a training step)
        if keep[k]:
            keep[k + 1:] &= ~overlaps[k, k + 1:]
    return order[keep]


def nms_mask(boxes: torch.Tensor, classes: torch.Tensor, valid: torch.Tensor, iou: float = 0.5) -> torch.Tensor:
    """Class-wise NMS of many images at once: boxes (N, K, 4) best first, classes (N, K), which
    rows take part ``valid`` (N, K) -> the kept rows (N, K), by :func:`nms_reference`'s rule in each
    image. One pass over the K columns for all N images, where a call per image spent a few
    hundred microseconds on the host for each (inference on many frames)."""
    over = (box_iou(boxes.float(), boxes.float()) > iou) & (classes[..., :, None] == classes[..., None, :])
    keep = valid.clone()
    for k in range(boxes.shape[1] - 1):  # a kept box drops the later boxes of its class that it overlaps
        keep[:, k + 1:] &= ~(over[:, k, k + 1:] & keep[:, k, None])
    return keep


# --- targets and decoding -------------------------------------------------------------------------

def centre_targets(boxes: torch.Tensor, labels: torch.Tensor, num_classes: int, grid: tuple[int, int],
                   stride: float):
    """The heat maps (N, K, h, w) and, per object, its centre cell's index (N, M), the centre's
    offset in that cell (N, M, 2) and the box's size in cells (N, M, 2); objects are where
    ``labels`` >= 0."""
    h, w = grid
    valid = labels >= 0
    centre = (boxes[..., :2] + boxes[..., 2:]) / (2 * stride)  # (N, M, 2) in cells
    cell = centre.floor().clamp_min(0)
    cell = torch.stack([cell[..., 0].clamp_max(w - 1), cell[..., 1].clamp_max(h - 1)], -1)
    size = (boxes[..., 2:] - boxes[..., :2]) / stride
    # TTFNet's elliptical Gaussian: a deviation of alpha * side / 6 on each axis
    sigma = (0.54 * size / 6).clamp_min(0.3)
    xs = torch.arange(w, device=boxes.device, dtype=boxes.dtype)
    ys = torch.arange(h, device=boxes.device, dtype=boxes.dtype)
    gx = ((xs[None, None, :] - cell[..., 0:1]) / sigma[..., 0:1]).square()  # (N, M, w)
    gy = ((ys[None, None, :] - cell[..., 1:2]) / sigma[..., 1:2]).square()  # (N, M, h)
    heat = torch.exp(-0.5 * (gy[..., :, None] + gx[..., None, :])) * valid[..., None, None]  # (N, M, h, w)
    n, m = labels.shape
    maps = torch.zeros((n, num_classes, h * w), device=boxes.device, dtype=heat.dtype)
    index = labels.clamp_min(0)[..., None].expand(n, m, h * w)
    maps = maps.scatter_reduce(1, index, heat.reshape(n, m, h * w), reduce="amax", include_self=True)
    position = (cell[..., 1] * w + cell[..., 0]).long()
    return maps.view(n, num_classes, h, w), position, centre - cell, size


def focal_loss(logits: torch.Tensor, heat: torch.Tensor, objects: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss (alpha 2, beta 4), summed and divided by the number
    of objects."""
    logits = logits.float()
    p = torch.sigmoid(logits)
    positive = heat >= 1.0 - 1e-4
    pos = F.logsigmoid(logits) * (1 - p).square()
    neg = F.logsigmoid(-logits) * p.square() * (1 - heat).pow(4)
    return -(torch.where(positive, pos, neg)).sum() / objects.clamp_min(1)


def decode(outputs: torch.Tensor, num_classes: int, stride: float, top_k: int = 100):
    """(boxes (N, k, 4) x0 y0 x1 y1 in input pixels, scores (N, k), classes (N, k)): the ``top_k``
    best heat-map peaks, best first. Fixed shapes, no host synchronisation."""
    n, _, h, w = outputs.shape
    heat = torch.sigmoid(outputs[:, :num_classes].float())
    peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat)
    scores, index = peaks.reshape(n, -1).topk(min(top_k, num_classes * h * w))
    classes, position = index // (h * w), index % (h * w)
    extra = outputs[:, num_classes:num_classes + 4].float().reshape(n, 4, h * w)
    offset_size = extra.gather(2, position[:, None, :].expand(n, 4, position.shape[1]))  # (N, 4, k)
    cx = (position % w).float() + offset_size[:, 0]
    cy = (position // w).float() + offset_size[:, 1]
    half_w, half_h = offset_size[:, 2].clamp_min(0) / 2, offset_size[:, 3].clamp_min(0) / 2
    boxes = torch.stack([cx - half_w, cy - half_h, cx + half_w, cy + half_h], -1) * stride
    return boxes, scores, classes


# --- metrics --------------------------------------------------------------------------------------

def match(boxes, scores, classes, gt_boxes, gt_labels, thresholds: torch.Tensor) -> torch.Tensor:
    """COCO's greedy matching of each image's detections (best score first) to its ground truth,
    at every IoU threshold: (N, T, k) bool, whether each detection is a true positive."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    boxes = boxes.gather(1, order[..., None].expand_as(boxes))
    classes = classes.gather(1, order)
    iou = box_iou(boxes, gt_boxes.to(boxes.dtype))  # (N, k, M)
    iou = torch.where((classes[..., None] == gt_labels[:, None, :]) & (gt_labels[:, None, :] >= 0), iou, -1.0)
    n, k, m = iou.shape
    taken = torch.zeros((n, len(thresholds), m), dtype=torch.bool, device=iou.device)
    hits = []
    for d in range(k):  # (sequential by rank; every image and threshold at once)
        candidates = torch.where(taken, -1.0, iou[:, None, d, :])  # (N, T, M)
        best, which = candidates.max(-1)
        hit = best >= thresholds[None, :]
        taken |= F.one_hot(which, m).bool() & hit[..., None]
        hits.append(hit)
    tp = torch.stack(hits, -1) if hits else torch.zeros((n, len(thresholds), 0), dtype=torch.bool, device=iou.device)
    # back to the detections' own order
    return torch.empty_like(tp).scatter_(2, order[:, None, :].expand_as(tp), tp)


def average_precision(scores: torch.Tensor, true_positive: torch.Tensor, positives: int) -> torch.Tensor:
    """COCO's 101-point interpolated AP of one class at each threshold: ``scores`` (D,),
    ``true_positive`` (T, D); -1 where the class has no ground truth."""
    if positives == 0:
        return torch.full((true_positive.shape[0],), -1.0)
    if scores.numel() == 0:
        return torch.zeros(true_positive.shape[0])
    order = scores.argsort(descending=True, stable=True)
    tp = true_positive[:, order].double()
    tp_sum, fp_sum = tp.cumsum(1), (1 - tp).cumsum(1)
    recall = tp_sum / positives
    precision = tp_sum / (tp_sum + fp_sum)
    precision = precision.flip(1).cummax(1).values.flip(1)  # the best precision at this recall or beyond
    points = torch.linspace(0, 1, RECALL_POINTS, dtype=torch.float64).expand(tp.shape[0], -1).contiguous()
    at = torch.searchsorted(recall.contiguous(), points, side="left")  # (T, 101): the first detection reaching it
    reached = at < tp.shape[1]
    q = torch.where(reached, precision.gather(1, at.clamp_max(tp.shape[1] - 1)), 0.0)
    return q.mean(1).float()


def coco_map(scores, classes, true_positive, gt_counts, num_classes: int) -> dict[str, float]:
    """{"map", "map50", "map75"} from every detection's score, class and true-positive flags
    (T, D), and the number of ground-truth boxes per class."""
    per_class = []
    for c in range(num_classes):
        mine = classes == c
        per_class.append(average_precision(scores[mine], true_positive[:, mine], int(gt_counts[c])))
    ap = torch.stack(per_class)  # (K, T)
    present = ap[:, 0] >= 0
    if not present.any():
        return {"map": float("nan"), "map50": float("nan"), "map75": float("nan")}
    ap = ap[present]
    return {"map": float(ap.mean()), "map50": float(ap[:, 0].mean()), "map75": float(ap[:, 5].mean())}


class DetectionCounts:
    """The detections of one evaluation, matched on the device batch by batch, shared by the
    ``map`` metrics (each reads its number from one computation at the end)."""

    def __init__(self, task: Detection):
        self.task = task
        self.reset()

    def reset(self) -> None:
        self.parts: list[tuple] = []
        self.gt_counts = None
        self._last = None
        self._result = None

    def add(self, outputs, targets) -> None:
        if outputs is self._last:  # (every map metric is handed the same batch)
            return
        self._last, self._result = outputs, None
        gt_boxes, gt_labels = targets
        boxes, scores, classes = self.task.decode(outputs)
        thresholds = torch.tensor(IOU_THRESHOLDS, device=scores.device)
        tp = match(boxes, scores, classes, gt_boxes, gt_labels, thresholds)
        self.parts.append((scores.flatten(), classes.flatten(), tp.permute(1, 0, 2).flatten(1)))
        # ground-truth boxes per class, without a host synchronisation (as bincount or a mask would need)
        counts = (F.one_hot(gt_labels.clamp_min(0), self.task.num_classes) * (gt_labels >= 0)[..., None]).sum((0, 1))
        self.gt_counts = counts if self.gt_counts is None else self.gt_counts + counts

    def result(self) -> dict[str, float]:
        if self._result is None:
            if not self.parts:
                return {"map": float("nan"), "map50": float("nan"), "map75": float("nan")}
            scores, classes, tp = (torch.cat(p, -1) for p in zip(*self.parts))
            parts = [(scores.cpu(), classes.cpu(), tp.cpu(), self.gt_counts.cpu())]
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                gathered = [None] * torch.distributed.get_world_size()  # every process's shard of the images
                torch.distributed.all_gather_object(gathered, parts[0])
                parts = gathered
            scores, classes, tp = (torch.cat(p, -1) for p in list(zip(*parts))[:3])
            gt_counts = sum(p[3] for p in parts)
            self._result = coco_map(scores, classes, tp, gt_counts, self.task.num_classes)
        return self._result


class MeanAveragePrecision(Metric):
    """One of COCO's APs (``which``: map, map50 or map75) over the evaluation set."""

    width = 0  # (its state is the shared DetectionCounts, gathered at the end)

    def __init__(self, counts: DetectionCounts, which: str = "map"):
        self.counts, self.which = counts, which

    def sums(self, outputs, targets):
        self.counts.add(outputs, targets)

    def finish(self, totals):
        return self.counts.result()[self.which]

    def reset(self) -> None:
        self.counts.reset()


class Decoded(torch.nn.Module):
    """A detector that returns its decoded detections (N, top_k, 6) instead of its maps: what an
    export carries, so that any runtime gets boxes."""

    def __init__(self, model: torch.nn.Module, task: Detection):
        super().__init__()
        self.model, self.task = model, task

    def forward(self, x):
        return self.task.predict(self.model(x))


class Detection(Task):
    """Boxes of ``num_classes`` kinds of object. A batch is (images, (boxes (N, M, 4) x0 y0 x1 y1
    pixels, labels (N, M), -1 where an image has fewer than M objects)); the model returns
    (N, num_classes + 4, H / stride, W / stride) (``gpuaccel.models.dense``' detectors)."""

    name = "detection"
    default_target = "map"

    def __init__(self, num_classes: int, stride: int = 4, top_k: int = 100, size_weight: float = 0.1):
        self.num_classes, self.stride, self.top_k, self.size_weight = num_classes, stride, top_k, size_weight
        self._counts = DetectionCounts(self)

    def split(self, batch):
        if isinstance(batch, (tuple, list)) and len(batch) == 3:
            return batch[0], (batch[1], batch[2])
        return super().split(batch)

    def loss(self, outputs, targets):
        boxes, labels = targets
        n, _, h, w = outputs.shape
        heat, position, offset, size = centre_targets(boxes.float(), labels, self.num_classes, (h, w), self.stride)
        valid = (labels >= 0).float()
        objects = valid.sum()
        loss = focal_loss(outputs[:, :self.num_classes], heat, objects)
        regressed = outputs[:, self.num_classes:self.num_classes + 4].float().reshape(n, 4, h * w)
        at_centres = regressed.gather(2, position[:, None, :].expand(n, 4, position.shape[1])).transpose(1, 2)
        l1 = (at_centres[..., :2] - offset).abs().sum(-1) + self.size_weight * (at_centres[..., 2:] - size).abs().sum(-1)
        return loss + (l1 * valid).sum() / objects.clamp_min(1)

    def metrics(self):
        return {name: MeanAveragePrecision(self._counts, name) for name in ("map", "map50", "map75")}

    def decode(self, outputs):
        return decode(outputs, self.num_classes, self.stride, self.top_k)

    def predict(self, outputs):
        """(N, top_k, 6): x0, y0, x1, y1 in input pixels, score, class; best first."""
        boxes, scores, classes = self.decode(outputs)
        return torch.cat([boxes, scores[..., None], classes[..., None].float()], -1)

    def deployed(self, module):
        return Decoded(module, self).train(module.training)

    def report(self, deployed_outputs):
        return deployed_outputs  # (already decoded inside the deployed model)

    def check_batch(self, outputs, targets) -> None:
        want = self.num_classes + 4
        if not isinstance(outputs, torch.Tensor) or outputs.dim() != 4 or outputs.shape[1] != want:
            shape = tuple(outputs.shape) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            raise GpuaccelError(f"task detection takes maps of {self.num_classes} class heat maps + 4 box channels "
                                f"(N, {want}, H/{self.stride}, W/{self.stride}); the model returned {shape}")
        labels = targets[1]
        if int(labels.max()) >= self.num_classes:
            raise GpuaccelError(f"a box has class {int(labels.max())}; the task has {self.num_classes} classes")

    def describe(self):
        return {"name": self.name, "num_classes": self.num_classes, "stride": self.stride, "top_k": self.top_k}
