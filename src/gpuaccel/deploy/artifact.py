"""A trained model as a deployable unit: weights, class names, input normalisation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from ..errors import GpuaccelError
from ..models import create_model
from ..tasks import SCENE_TASKS, Classification, Task, task_of
from ..train.config import saved_settings
from ..models.registry import add_search_dir
from ..train import checkpoint
from ..models.structure import apply_structure


class Normalized(nn.Module):
    """The model with its input normalisation built in: it takes float images in [0, 1],
    so an exported artefact needs nothing beside it to be used correctly."""

    def __init__(self, model: nn.Module, mean, std):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))

    def forward(self, x):
        return self.model((x - self.mean) / self.std)


@dataclass
class TrainedModel:
    module: Normalized  # eval mode, on the CPU, float32
    classes: list[str]
    model_name: str
    model_args: dict
    config: dict
    source: Path
    task: Task = field(default_factory=Classification)

    def example_input(self, batch: int) -> torch.Tensor:
        """What an export is traced with: images as the deployed model takes them (float32 in [0, 1])."""
        return self.task.example_input(batch, (self.in_channels, self.image_size, self.image_size))

    @property
    def in_channels(self) -> int:
        return self.model_args["in_channels"]

    @property
    def image_size(self) -> int:
        return self.model_args["image_size"]

    def load_data(self, spec: str | None, why: str):
        """The run's data set (split as in training), or ``spec`` instead, at the model's image size.
        ``why`` opens the error message when it cannot be read."""
        from ..data import load_dataset

        try:
            data = load_dataset(spec or self.config.get("data"), val_split=None if spec else self.config.get("val_split"),
                                image_size=self.image_size, seed=self.config.get("seed", 0))
        except GpuaccelError as exc:
            raise GpuaccelError(f"{why} ({exc}); pass --data SPEC") from None
        if data.in_channels != self.in_channels:
            raise GpuaccelError(f"--data has {data.in_channels}-channel images; the model takes {self.in_channels}")
        return data


def load_run_state(path) -> tuple[dict, Path]:
    """The state in ``model.pt`` or ``checkpoint.pt`` of a run (or of the run directory itself),
    and the file it came from."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.pt" if (path / "model.pt").exists() else path / "checkpoint.pt"
    if not path.exists():
        raise GpuaccelError(f"{path} does not exist; give a run directory or its model.pt")
    state = checkpoint.load(path)
    if state.get("model") is None and state.get("shards"):
        raise GpuaccelError(f"{path} is a sharded run's checkpoint: its weights are shards of each process "
                            f"({state['shards']}); use the model.pt the run writes when it ends")
    name = state["model_name"]
    if name.startswith("object:"):
        raise GpuaccelError(f"{path} holds the weights of a model passed to the trainer as an object "
                            f"({name[7:]}); build that model in Python and load_state_dict(torch.load(...)['model']), "
                            f"or train with a registered model or package.module:factory")
    return state, path


def run_kind(path) -> str | None:
    """What a run (or its checkpoint) at ``path`` trained: "text" (a tokeniser), "audio" (a
    waveform classifier), "detection", "segmentation" or "image"; None for anything that is not a run (e.g. an .onnx file)."""
    path = Path(path)
    if not (path.is_dir() or path.suffix == ".pt"):
        return None
    try:
        state, _ = load_run_state(path)
    except GpuaccelError:
        return None
    task = (state.get("task") or {}).get("name")
    if task in SCENE_TASKS:
        return task
    return "text" if state.get("tokenizer") else "audio" if state.get("audio") else "image"


def run_data_kind(path):
    """The registered data kind (``data.kinds``) of the run at ``path``, which exports it and
    makes its held-out data; a one-line error for a run with none (its data came from Python)."""
    from ..data.kinds import kind_of_run

    state, source = load_run_state(path)
    kind = kind_of_run(state)
    if kind is None:
        raise GpuaccelError(f"{source} was trained on data passed from Python (config data 'python'); export and "
                            f"evaluate it in Python, or train on data gpuaccel reads (--data)")
    return kind


def max_tokens(state: dict) -> int:
    """The most tokens of a sentence a run's text classifier takes."""
    return state["model_args"].get("context_length") or saved_settings(state["config"]).get("context", 256)


def rebuild_model(state: dict, path: Path) -> nn.Module:
    """The run's model with its trained weights (the weight average where the run kept one: that
    is the model it evaluated), in training mode, on the CPU."""
    add_search_dir(state.get("model_path"))
    try:
        model = create_model(state["model_name"], **state["model_args"])
        if state.get("structure"):  # a channel-pruned model: narrower layers than the registry's
            apply_structure(model, state["structure"])
        model.load_state_dict(state.get("ema_model") or state["model"])
    except (KeyError, RuntimeError) as exc:
        raise GpuaccelError(f"{path}: the checkpoint's weights do not fit its model ({exc!s:.200})") from None
    return model


def load_trained(path) -> TrainedModel:
    """An image classifier of a run, ready to export or infer with."""
    state, path = load_run_state(path)
    if state.get("audio") or state.get("tokenizer"):
        what = "an audio classifier" if state.get("audio") else f"a text model (task {state.get('task', {}).get('name')!r})"
        raise GpuaccelError(f"{path} is {what}; this command works on image classifiers (export, infer and quantize "
                            f"take text and audio classifiers too; a language model samples with 'gpuaccel generate')")
    if state.get("classes") is None or state.get("mean") is None:
        raise GpuaccelError(f"{path} is not an image classifier (task {state.get('task', {}).get('name')!r}); "
                            f"this command works on image classification runs")
    module = Normalized(rebuild_model(state, path), state["mean"], state["std"]).eval()
    task = task_of(state.get("task"))
    return TrainedModel(module, list(state["classes"]), state["model_name"], dict(state["model_args"]),
                        saved_settings(state["config"]), path, task)
