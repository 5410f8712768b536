"""The training configuration: plain data, validated once at the edge.

Every field is a command-line option of ``gpuaccel train`` (underscores become dashes)
and a key of a recipe file; ``config.json`` in each run directory is this, resolved.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..compiling import COMPILE_MODES
from ..data.augment import FLIP_MODES
from ..data.loader import PLACEMENTS
from ..data.stream import check_cpu_decode
from ..device import PRECISIONS
from ..errors import GpuaccelError, choice_error
from ..parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES

OPTIMIZERS = ("sgd", "adamw", "muon")
SCHEDULES = ("onecycle", "cosine", "constant")
LOADERS = PLACEMENTS + ("stream",)
OFFLOADS = ("none", "cpu")


@dataclass
class TrainConfig:
    # what to train on what
    data: str = "digits"  # a data spec; "python" when train_data came through the Python API
    model: str = "lenet5"  # a registry name, package.module:factory, timm:NAME; "object:Class" for a passed module
    model_path: str | None = None  # where package.module:factory was imported from (recorded by the trainer)
    task: str | None = None  # classification or regression; None: the data's own (image data: classification)
    val_split: float | None = None
    image_size: int | None = None
    skip_bad: bool = False
    cache_dir: str | None = "default"
    # where and how precisely
    device: str = "auto"
    precision: str = "auto"
    channels_last: bool | None = None  # None: on for GPUs
    compile: bool = False
    compile_mode: str = "default"
    step_graph: bool = True  # with compile mode reduce-overhead: the whole step as one CUDA graph where possible
    deterministic: bool = False  # deterministic kernels (process-wide): the same weights from the same seed on GPUs
    sync_bn: bool = False  # several processes: batch-norm statistics over the global batch (GPUs)
    ddp_bucket_mb: float = 25.0  # several processes: gradient all-reduce bucket size
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass
    shard: bool = False  # FSDP: parameters, gradients and optimizer state split across the processes
    offload: str = "none"  # with shard: "cpu" keeps parameters, gradients and optimizer state in host memory
    pipeline_stages: int = 1  # >1: the model split into this many stages on consecutive processes
    microbatches: int | None = None  # per batch, with pipeline stages; None: see pipeline_microbatches
    pipeline_schedule: str = "1f1b"  # or gpipe
    split_points: list[str] | None = None  # module names to split before; None: balanced by FLOPs
    loader: str = "auto"  # auto: on the GPU when the data fits; gpu; cpu (worker processes); stream (JPEG files)
    workers: int | None = None  # loader processes (cpu loader: None is cores / local ranks - 1, at most 8;
    #   stream: reader processes, None is cores / local ranks - 2)
    cpu_decode: float | None = None  # stream with nvJPEG: share of each batch the reader processes decode
    # optimisation
    optimizer: str = "sgd"  # sgd; adamw; muon: orthogonalised updates for convolution filters, SGD for the rest
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    bias_lr_scale: float = 1.0  # learning-rate multiplier for biases and norm parameters (no weight decay)
    muon_lr: float = 0.24  # optimizer muon: learning rate of the convolution filters
    muon_momentum: float = 0.6  # optimizer muon: the filters' momentum
    schedule: str = "onecycle"
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.0
    grad_accum: int = 1
    grad_clip: float | None = None
    batch_size: int = 128
    eval_batch_size: int = 1024
    seed: int = 0
    ema: float | None = None  # decay of an exponential moving average of the weights, used for evaluation
    tta: int = 0  # test-time augmentation: 0 none, 1 + horizontal flip, 2 + one-pixel translations
    # augmentation (applied on the device; see data/augment.py)
    crop_padding: int = 0
    flip: str = "none"
    cutout: int = 0
    # when to stop
    epochs: float = 10  # may end inside an epoch: 9.5 stops halfway through the tenth
    time_limit: float | None = None
    target: str | None = None  # METRIC=VALUE: stop once the held-out METRIC reaches VALUE (e.g. accuracy=0.99)
    target_acc: float | None = None  # the older spelling of target accuracy=F; validate() turns it into target
    # bookkeeping
    run_dir: str | None = None
    eval_every: int | None = None  # optimizer steps; None: at the end of every epoch
    checkpoint_every: int | None = None  # optimizer steps; epochs are always checkpointed
    checkpoint_seconds: float = 300.0
    monitor: bool = True  # sample GPU telemetry into gpu.jsonl (needs nvidia-ml-py)
    profile: bool = False  # a torch.profiler trace of a few steps in profile/
    tensorboard: bool = False  # TensorBoard scalars in tensorboard/

    def validate(self) -> "TrainConfig":
        """Raises GpuaccelError naming the first bad value and the valid ones."""
        for name, valid in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES), ("precision", PRECISIONS),
                            ("flip", FLIP_MODES), ("loader", LOADERS), ("compile_mode", COMPILE_MODES),
                            ("offload", OFFLOADS), ("pipeline_schedule", PIPELINE_SCHEDULES)):
            if getattr(self, name) not in valid:
                raise choice_error(name.replace("_", " "), getattr(self, name), valid)
        positive = ("batch_size", "eval_batch_size", "grad_accum", "pipeline_stages")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise GpuaccelError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {getattr(self, name)}")
        if self.ema is not None and not 0 < self.ema < 1:
            raise GpuaccelError(f"--ema is a decay in (0, 1) (e.g. 0.99), got {self.ema}")
        if self.tta not in (0, 1, 2):
            raise GpuaccelError(f"--tta must be 0 (none), 1 (flip) or 2 (flip and translate), got {self.tta}")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, (int, float)) or not self.epochs > 0:
            raise GpuaccelError(f"--epochs must be a positive number, got {self.epochs}")
        if not self.lr > 0:
            raise GpuaccelError(f"--lr must be positive, got {self.lr}")
        if not self.ddp_bucket_mb > 0:
            raise GpuaccelError(f"--ddp-bucket-mb must be positive, got {self.ddp_bucket_mb}")
        if not self.muon_lr > 0:
            raise GpuaccelError(f"--muon-lr must be positive, got {self.muon_lr}")
        if not 0 <= self.muon_momentum < 1:
            raise GpuaccelError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        if self.optimizer == "muon" and self.shard:
            raise GpuaccelError("--optimizer muon needs each filter bank whole and does not work with --shard; "
                                "use sgd or adamw")
        if not self.bias_lr_scale > 0:
            raise GpuaccelError(f"--bias-lr-scale must be positive, got {self.bias_lr_scale}")
        for name in ("weight_decay", "crop_padding", "cutout", "warmup_epochs", "checkpoint_seconds"):
            if getattr(self, name) < 0:
                raise GpuaccelError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.momentum < 1:
            raise GpuaccelError(f"--momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.label_smoothing < 1:
            raise GpuaccelError(f"--label-smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.target_acc is not None:
            if not 0 < self.target_acc <= 1:
                raise GpuaccelError(f"--target-acc is a fraction in (0, 1] (e.g. 0.99), got {self.target_acc}")
            alias = f"accuracy={self.target_acc:g}"
            if self.target is not None and parse_target(self.target) != parse_target(alias):
                raise GpuaccelError(f"--target {self.target} and --target-acc {self.target_acc:g} disagree; give one")
            self.target, self.target_acc = alias, None
        if self.target is not None:
            parse_target(self.target)
        if self.task is not None:
            from ..tasks import TASKS

            if self.task not in TASKS:
                raise choice_error("task", self.task, sorted(TASKS))
        for name in ("time_limit", "grad_clip"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise GpuaccelError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if self.shard and self.ema is not None:
            raise GpuaccelError("--ema is not supported with --shard (the weight average would not be sharded)")
        if self.shard and self.sync_bn:
            raise GpuaccelError("--sync-bn is for data parallel without --shard")
        if self.offload == "cpu" and not self.shard:
            raise GpuaccelError("--offload cpu works with --shard (FSDP moves each block's parameters to the GPU "
                                "when it runs); add --shard")
        if self.pipeline_stages > 1:
            self._validate_pipeline()
        elif self.microbatches is not None or self.split_points is not None:
            raise GpuaccelError("--microbatches and --split-points are for --pipeline-stages 2 or more")
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 0):
            raise GpuaccelError(f"--workers must be a whole number >= 0, got {self.workers}")
        check_cpu_decode(self.cpu_decode)
        for name in ("eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise GpuaccelError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value}")
        return self

    @property
    def target_metric(self) -> tuple[str, float] | None:
        """(metric, value) of ``target``, or None."""
        return None if self.target is None else parse_target(self.target)

    @property
    def pipeline_microbatches(self) -> int:
        """--microbatches, or the fewest that divide the batch evenly and number at least
        max(4, 2 x stages) (fewer leave the stages idle longer at the start and end of a step)."""
        if self.microbatches:
            return self.microbatches
        least = max(4, 2 * self.pipeline_stages)
        return next((m for m in range(least, self.batch_size + 1) if self.batch_size % m == 0), self.batch_size)

    def _validate_pipeline(self) -> None:
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise GpuaccelError(f"--microbatches must be a whole number >= 1, got {self.microbatches}")
        if self.batch_size % self.pipeline_microbatches:
            raise GpuaccelError(f"--batch-size {self.batch_size} does not split into {self.pipeline_microbatches} "
                                f"equal micro-batches; change --batch-size or --microbatches")
        if self.split_points is not None and len(self.split_points) != self.pipeline_stages - 1:
            raise GpuaccelError(f"--split-points names {len(self.split_points)} module(s); "
                                f"{self.pipeline_stages} stages need {self.pipeline_stages - 1}")
        unsupported = {"--shard": self.shard, "--ema": self.ema is not None, "--sync-bn": self.sync_bn,
                       "--grad-accum (use --microbatches)": self.grad_accum > 1,
                       "--precision fp16": self.precision == "fp16",
                       "--compile-mode reduce-overhead (CUDA graphs)":
                           self.compile and self.compile_mode == "reduce-overhead"}
        for option, used in unsupported.items():
            if used:
                raise GpuaccelError(f"{option} is not supported with --pipeline-stages")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Builds a config from a recipe or a saved config.json; unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise GpuaccelError(f"unknown training setting(s) {', '.join(unknown)}; "
                                f"valid ones: {', '.join(sorted(known))}")
        return cls(**values)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)


def parse_target(text: str) -> tuple[str, float]:
    """'accuracy=0.99' -> ('accuracy', 0.99); a bare number means accuracy."""
    name, sep, value = str(text).partition("=")
    if not sep:
        name, value = "accuracy", name
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not name.strip() or number != number:
        raise GpuaccelError(f"--target is METRIC=VALUE (e.g. accuracy=0.99 or val_loss=1.47), got {text!r}")
    return name.strip(), number
