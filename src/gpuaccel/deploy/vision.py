"""Deploying detectors and segmenters: export verified against PyTorch on held-out images, and
inference that writes boxes (CSV or JSON) or masks (PNG files), with overlays for a person to
look at.

A detector's artefact returns its decoded detections, (N, top_k, 6): x0, y0, x1, y1 in the
model's input pixels, score, class; best first (tasks.detection.Decoded). Inference keeps those
above ``score``, thins them by class-wise NMS and scales them to each image's own size. A
segmenter's artefact returns per-pixel logits (N, K, H, W); inference writes each image's class
map, at the image's own size, as an 8-bit PNG (pixel value = class index, 0 the background).
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import GpuaccelError, choice_error
from ..files import atomic_write, make_directory
from .artifact import TrainedModel, load_trained
from .export import FORMATS, export
from .runners import FORMAT_SUFFIX, Runner, load_runner

BOX_TOLERANCE = 1e-3  # pixels: an export's boxes against PyTorch's
MASK_AGREEMENT = 0.999  # of pixels: an export's class maps against PyTorch's


@dataclass
class SceneInputs:
    names: list[str]
    images: np.ndarray  # uint8 (N, C, H, W) at the model's size
    sizes: list[tuple[int, int]]  # each image's own (width, height)
    files: list[str | None]  # where each image can be read again (for overlays)


def read_scene_inputs(runner: Runner, inputs: list[str], skip_bad: bool = False):
    """Image files or folders of them (each at its own size), or a detection / segmentation data
    set's held-out split: ``chunks()`` of :class:`SceneInputs`, the files decoded a chunk ahead
    (deploy/infer.py), so memory does not grow with their number."""
    from ..data import parse_spec
    from ..data.scenes import SCENE_KINDS, load_scenes
    from .infer import ahead, decoded, images_in

    paths = [Path(p).expanduser() for p in inputs]
    if len(paths) == 1 and not paths[0].is_file():
        kind, path = parse_spec(inputs[0])
        if kind in SCENE_KINDS:
            data = load_scenes(path, kind, image_size=runner.image_size).test
            h, w = data.images.shape[2:]

            def held_out():
                from . import infer

                for start in range(0, len(data), infer.CHUNK):
                    names = data.names[start:start + infer.CHUNK]
                    yield SceneInputs(names, data.images[start:start + infer.CHUNK], [(w, h)] * len(names),
                                      [str(path / n) for n in names])
            return held_out
    files = []
    for p in paths:
        if p.is_dir():
            files += images_in(p)
        elif p.is_file():
            files.append(str(p))
        else:
            raise GpuaccelError(f"{p} does not exist")
    if not files:
        raise GpuaccelError(f"no image files in {', '.join(inputs)}")

    def sized():
        for chunk in decoded(files, skip_bad=skip_bad, image_size=runner.image_size):
            sizes = chunk.sizes  # (each image's own, upright: its boxes are scaled back to it)
            images = chunk.samples
            if images.shape[1] != runner.in_channels:
                images = np.repeat(images[:, :1], runner.in_channels, 1) if runner.in_channels == 3 else \
                    images.mean(1, keepdims=True).round().astype(np.uint8)
            yield SceneInputs(chunk.names, images, sizes, chunk.names)
    return lambda: ahead(sized())


def run_batches(runner: Runner, images: np.ndarray, batch_size: int, latency=None) -> tuple[np.ndarray, dict]:
    """The deployed model's outputs for uint8 ``images``, and latency statistics."""
    from .infer import images_for_model, predict

    return predict(runner, images, batch_size, images_for_model, raw=True, latency=latency)


def kept_detections(decoded: np.ndarray, score: float, iou: float, images_at_once: int = 1024) -> list[np.ndarray]:
    """Per image, its detections (D, 6) above ``score`` after class-wise NMS, best first; the
    images of ``decoded`` (N, top_k, 6) ``images_at_once`` at a time (:func:`nms_mask`)."""
    from ..tasks.detection import nms_mask

    kept, counts = [], []
    for start in range(0, len(decoded), images_at_once):
        rows = torch.from_numpy(np.ascontiguousarray(decoded[start:start + images_at_once]))
        order = rows[..., 4].argsort(dim=1, descending=True, stable=True)  # (best first: those above score lead)
        rows = rows.gather(1, order[..., None].expand_as(rows))
        valid = rows[..., 4] >= score
        width = int(valid.sum(1).max())
        rows, valid = rows[:, :width], valid[:, :width]
        keep = nms_mask(rows[..., :4], rows[..., 5].long(), valid, iou)
        kept.append(rows[keep].numpy())  # (every image's kept rows, image after image)
        counts.append(keep.sum(1).numpy())
    return _per_image(np.concatenate(kept), np.concatenate(counts)) if kept else []


def scaled_to_images(kept: list[np.ndarray], sizes, model_hw: tuple[int, int]) -> list[np.ndarray]:
    """Each image's detections with their boxes scaled from the model's input to the image's own
    size (``sizes``: (width, height) each); all images' rows at once."""
    if not kept:
        return []
    rows = np.concatenate(kept)  # (a copy: the given rows stay as they are)
    counts = np.array([len(r) for r in kept])
    for columns, scale in (([0, 2], [w / model_hw[1] for w, _ in sizes]), ([1, 3], [h / model_hw[0] for _, h in sizes])):
        rows[:, columns] *= np.repeat(np.asarray(scale, dtype=rows.dtype), counts)[:, None]
    return _per_image(rows, counts)


def _per_image(rows: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """``rows`` of consecutive images, ``counts[i]`` of them image i's, as one array per image."""
    return np.split(rows, np.cumsum(counts)[:-1])


def detections_table(names, kept: list[np.ndarray], classes: list[str]) -> list[tuple]:
    """One row per box, in :attr:`DetectionsWriter.FIELDS`' order: image, class, score, x, y, w, h
    (pixels of the image itself); column by column (a chunk of frames holds some 10^5 boxes)."""
    counts = [len(rows) for rows in kept]
    if not sum(counts):
        return []
    rows = np.concatenate([r for r in kept if len(r)])

    def rounded(values: np.ndarray, digits: int) -> list[float]:
        return [round(v, digits) for v in values.tolist()]  # (Python's rounding of each value, as written)
    image = [name for name, n in zip(names, counts) for _ in range(n)]
    names_of = [classes[i] for i in rows[:, 5].astype(np.int64).tolist()]
    return list(zip(image, names_of, rounded(rows[:, 4], 5), rounded(rows[:, 0], 2), rounded(rows[:, 1], 2),
                    rounded(rows[:, 2] - rows[:, 0], 2), rounded(rows[:, 3] - rows[:, 1], 2)))


def detections_text(rows: list[tuple], fmt: str) -> str:
    """``rows`` (:func:`detections_table`) as CSV or as a JSON array, whole."""
    out = io.StringIO()
    writer = DetectionsWriter(out.write, fmt)
    writer.add(rows)
    writer.close()
    return out.getvalue()


class DetectionsWriter:
    """Detections written as they come, chunk by chunk (``add`` of :func:`detections_table`'s
    rows), through ``write(text)``, one call a chunk: CSV with one header, or one JSON array
    (``close`` ends it)."""

    FIELDS = ("image", "class", "score", "x", "y", "w", "h")

    def __init__(self, write, fmt: str):
        self.write, self.json, self.rows = write, fmt == "json", 0
        if self.json:
            write("[")
        else:
            write(_csv_text([self.FIELDS]))

    def add(self, rows: list[tuple]) -> None:
        if self.json:
            text = "".join(("," if k else "") + "\n " + json.dumps(dict(zip(self.FIELDS, row)))
                           for k, row in enumerate(rows, self.rows))
        else:
            text = _csv_text(rows)
        self.rows += len(rows)
        if text:
            self.write(text)

    def close(self) -> None:
        if self.json:
            self.write("\n]\n" if self.rows else "]\n")


def _csv_text(rows) -> str:
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue()


def class_maps(logits: np.ndarray, sizes) -> list[np.ndarray]:
    """Each image's class map (uint8) at its own size (nearest neighbour)."""
    from PIL import Image

    maps = []
    for scores, (w, h) in zip(logits, sizes):
        index = scores.argmax(0).astype(np.uint8)
        if index.shape != (h, w):
            index = np.asarray(Image.fromarray(index).resize((w, h), Image.Resampling.NEAREST))
        maps.append(index)
    return maps


def write_masks(directory: Path, names, maps: list[np.ndarray]) -> list[Path]:
    from PIL import Image

    make_directory(directory)
    written = []
    for name, index in zip(names, maps):
        path = directory / (Path(name).stem + ".png")
        atomic_write(path, lambda f, index=index: Image.fromarray(index).save(f, format="PNG"))
        written.append(path)
    return written


PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128), (220, 190, 255)]


def draw_overlays(directory: Path, inputs: SceneInputs, classes: list[str], kept=None, maps=None) -> None:
    """Each image with its boxes (class and score) or its class map blended in, as PNG."""
    from PIL import Image, ImageDraw

    make_directory(directory)
    for k, name in enumerate(inputs.names):
        if inputs.files[k] and Path(inputs.files[k]).is_file():
            with Image.open(inputs.files[k]) as img:
                picture = img.convert("RGB")
        else:
            picture = Image.fromarray(inputs.images[k].transpose(1, 2, 0).squeeze())
            picture = picture.convert("RGB").resize(inputs.sizes[k])
        if maps is not None:
            colours = np.array([(0, 0, 0)] + [PALETTE[c % len(PALETTE)] for c in range(len(classes))], np.uint8)
            tint = colours[np.minimum(maps[k], len(colours) - 1)]
            blend = np.asarray(picture, np.float32)
            on = maps[k] > 0
            blend[on] = 0.45 * blend[on] + 0.55 * tint[on]
            picture = Image.fromarray(blend.astype(np.uint8))
        if kept is not None:
            draw = ImageDraw.Draw(picture)
            for x0, y0, x1, y1, score, cls in kept[k]:
                colour = PALETTE[int(cls) % len(PALETTE)]
                draw.rectangle([x0, y0, x1, y1], outline=colour, width=2)
                draw.text((x0 + 2, max(0, y0 - 11)), f"{classes[int(cls)]} {score:.2f}", fill=colour)
        atomic_write(directory / (Path(name).stem + ".png"), lambda f, p=picture: p.save(f, format="PNG"))


# --- export ---------------------------------------------------------------------------------------

def export_scene_model(checkpoint, fmt: str, out=None, *, data: str | None = None, verify_count: int = 1000,
                       static_batch: int | None = None, opset: int | None = None) -> tuple[dict, str]:
    """Exports a detector or segmenter and verifies the artefact on held-out images against the
    model in PyTorch: a detector's boxes (score >= 0.05) within BOX_TOLERANCE pixels with the same
    classes, before and after NMS; a segmenter's class maps equal on MASK_AGREEMENT of the pixels."""
    if fmt not in FORMATS:
        raise choice_error("export format", fmt, FORMATS)
    trained = load_trained(checkpoint)
    out = Path(out) if out else trained.source.with_name(f"model{FORMAT_SUFFIX[fmt]}")
    images = held_out_images(trained, data)[:verify_count]
    static = static_batch is not None
    path = export(trained, fmt, out, dynamic_batch=not static, static_batch=static_batch or 2, opset=opset)
    batch = static_batch or 64
    images = images[: len(images) - len(images) % batch] if static else images
    reference = trained.task.deployed(trained.module).eval()
    runner = load_runner(path)
    with torch.no_grad():
        expected = np.concatenate([reference(torch.from_numpy(images[s:s + batch].astype(np.float32) / 255)).numpy()
                                   for s in range(0, len(images), batch)])
    got, _ = run_batches(runner, images, batch)
    report = compare_detections(expected, got) if trained.task.name == "detection" else compare_masks(expected, got)
    report.update(images=len(images), artifact=str(path), format=fmt, size_bytes=path.stat().st_size)
    return report, "images"


def held_out_images(trained: TrainedModel, data: str | None) -> np.ndarray:
    from ..data import parse_spec
    from ..data.scenes import SCENE_KINDS, load_scenes, scene_kind

    spec = data or trained.config.get("data")
    try:
        kind, path = parse_spec(spec)
        if kind in SCENE_KINDS and not str(spec).lower().startswith(f"{kind}:"):
            kind = scene_kind(path, trained.task.name)
        if kind not in SCENE_KINDS:
            raise GpuaccelError(f"{spec} is {kind} data, not detection or segmentation data")
        return load_scenes(path, kind, image_size=trained.image_size, val_split=None if data else
                           trained.config.get("val_split"), seed=trained.config.get("seed", 0)).test.images
    except GpuaccelError as exc:
        raise GpuaccelError(f"cannot load held-out images to verify the export ({exc}); pass --data SPEC") from None


def compare_detections(expected: np.ndarray, got: np.ndarray, score: float = 0.05) -> dict:
    """Detections (N, k, 6) of PyTorch and of an artefact. Each of PyTorch's detections scored at
    least ``score`` is paired with the artefact's closest box of its class (peaks of near-equal
    score may swap ranks); then the boxes left after the score threshold and NMS are compared.
    Where no detection reaches ``score`` (a model that finds nothing on these images), every one
    of the top-k boxes is compared instead: a check of no boxes would pass anything."""
    if not (expected[..., 4] >= score).any():
        score = -np.inf
    worst, compared, unpaired = 0.0, 0, 0
    for want, have in zip(expected, got):
        for row in want[want[:, 4] >= score]:
            same = have[have[:, 5] == row[5]]
            compared += 1
            if not len(same):
                unpaired += 1
                continue
            worst = max(worst, float(np.abs(same[:, :4] - row[:4]).max(1).min()))
    after_e, after_g = kept_detections(expected, 0.3, 0.5), kept_detections(got, 0.3, 0.5)
    same_count = all(len(a) == len(b) for a, b in zip(after_e, after_g))
    nms_diff = max([float(np.abs(a[:, :4] - b[:, :4]).max(initial=0.0)) for a, b in zip(after_e, after_g)
                    if len(a) == len(b)] + [0.0])
    passed = compared > 0 and worst <= BOX_TOLERANCE and not unpaired and same_count and nms_diff <= BOX_TOLERANCE
    return {"detections_compared": compared, "compared_at_score": None if score == -np.inf else score,
            "max_box_diff": worst, "unpaired": unpaired,
            "boxes_after_nms": int(sum(len(a) for a in after_e)), "after_nms_same_count": same_count,
            "max_box_diff_after_nms": nms_diff, "passed": passed}


def compare_masks(expected: np.ndarray, got: np.ndarray) -> dict:
    agreement = float((expected.argmax(1) == got.argmax(1)).mean())
    diff = np.abs(expected - got)
    return {"pixel_agreement": agreement, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "passed": agreement >= MASK_AGREEMENT}

