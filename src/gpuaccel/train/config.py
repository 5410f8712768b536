"""The training configuration: one schema, in sections, validated once at the edge.

Each setting is declared once below, in the section it belongs to (data, model, runtime,
parallel, optimizer, loop, logging), with its help text and valid values. ``TrainConfig`` holds
one object per section (``config.optimizer.lr``, ``config.loop.epochs``); a section checks its own
values, and ``TrainConfig.validate`` checks how the sections combine.

Every setting also has one flat name, the command line's option without its dashes (``lr``,
``batch_size``; the three whose field repeats its section's name: ``data`` is ``data.source``,
``model`` is ``model.name``, ``optimizer`` is ``optimizer.name``). Flat names are what
``gpuaccel train`` options (cli/options.py builds them from this schema), flat recipes,
``TrainConfig(lr=0.1)`` and ``config.replace(lr=0.1)`` take. ``config.json`` in each run
directory and ``gpuaccel train --print-config`` are the nested form (:meth:`TrainConfig.to_dict`);
:meth:`TrainConfig.from_dict` reads either form.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass

from ..compiling import COMPILE_MODES
from ..data.augment import FLIP_MODES, parse_size_schedule
from ..data.loader import PLACEMENTS
from ..data.text import TOKENIZERS
from ..device import PRECISIONS, precision_name
from ..errors import GpuaccelError, choice_error
from ..settings import check_whole, setting
from ..parallel.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from ..tasks import TASKS

LOSS_ALIASES = ("val_loss", "test_loss", "eval_loss", "validation_loss")
DEFAULT_MODEL = "lenet5"  # for images; other data kinds have their own (TrainingInputs.default_model)


@dataclass
class CommonDataSettings:
    """What is read, and how it reaches the device: the settings that more than one kind of data
    reads. A setting only one kind reads is declared in that kind's file (``DataKind.options``,
    e.g. kinds/translation.py's ``--batch-tokens``) and joined to these in :data:`DataSettings`."""
    source: str = setting(
        "digits", "'digits' (built in, the default); a path: MNIST IDX directory, CIFAR-10/100 pickle directory, image "
        "folder (train/<class>/*.jpg [test/<class>/...] or <class>/*.jpg), .tar/.tar.gz of such a folder, a "
        "directory of .tar shards (streamed), .npz, text (.txt; labelled sentences .tsv/.csv/.jsonl), or "
        "recordings (a folder or .tar.gz of .wav files), detection (annotations/instances_train.json: COCO; images/ + "
        "labels/: YOLO) or segmentation (images/ + masks/) folders, sentence pairs to translate (train.de + train.en, "
        "...); or KIND:PATH with KIND one of audio, cifar10, cifar100, coco, digits, fashion-mnist, idx, "
        "imagefolder, masks, mnist, npz, ratings, sentences, tar, text, translation, yolo ('python' in a run whose "
        "data came from Python)",
        metavar="SPEC", flag="data")
    val_split: float | None = setting(
        None, "hold out fraction F of the training samples for evaluation, for data without a test split "
        "(default 0.1; 0.2 for digits)", metavar="F")
    image_size: int | None = setting(
        None, "resize every image to NxN (default: keep; mixed sizes go to the most common size; "
        "streamed data: crops of 224)", metavar="N")
    skip_bad: bool = setting(False, "skip images that cannot be decoded (they are counted) instead of "
                                            "stopping")
    cache_dir: str | None = setting("default", "where decoded images are cached (default "
                                                       "~/.cache/gpuaccel or $GPUACCEL_CACHE_DIR)", metavar="DIR")
    loader: str = setting(
        "auto", "auto (the data set lives in GPU memory when it fits), gpu, cpu (worker processes; "
        "batches are copied to the GPU one step ahead), or stream (JPEG files read and decoded every step, on "
        "the GPU with nvJPEG where there is one: for data larger than memory; .tar shards are always streamed)",
        choices=PLACEMENTS + ("stream",), metavar="WHERE")
    workers: int | None = setting(
        None, "processes of the cpu loader (default: cores - 1, at most 8); with --loader stream, reader "
        "processes (default: cores - 2)", metavar="N")
    tokenizer: str | None = setting(
        None, "text: char (each distinct character a token; the default for a corpus), byte (UTF-8 "
        "bytes), word (lower-cased words of the training split; the default for labelled sentences) or bpe (a "
        "byte-level BPE vocabulary learned from the training split; needs tokenizers)", choices=TOKENIZERS,
        metavar="KIND")
    vocab_size: int | None = setting(None, "text, --tokenizer bpe or word: the vocabulary's size (default: "
                                                   "bpe 2048; word: every word seen twice)", metavar="N")
    context: int = setting(256, "text: tokens per training window of a language model (its context "
                                        "length); the most tokens kept of a sentence to classify", metavar="TOKENS")
    crop_padding: int = setting(0, "random translation by up to P pixels", metavar="P")
    flip: str = setting("none", "horizontal flips", choices=FLIP_MODES, metavar="MODE")
    cutout: int = setting(0, "zero a random SxS square in each image", metavar="S")
    brightness: float = setting(0.0, "shift each image's pixels by a random amount, up to B of the full "
                                             "range", metavar="B")
    contrast: float = setting(0.0, "scale each image's deviations from the mean pixel by a random "
                                           "factor in [1 - C, 1 + C]", metavar="C")
    size_schedule: list[str] | None = setting(
        None, "progressive resizing: train the first epochs on smaller images, e.g. 24:3,28:2 (3 epochs "
        "at 24x24, then 2 at 28x28, then full size); each size compiles and captures its own step", metavar="SIZE:EPOCHS,...")

    def validate(self) -> None:
        for name in ("crop_padding", "cutout"):
            _at_least(self, name, 0)
        for name in ("brightness", "contrast"):
            if not 0 <= getattr(self, name) < 1:
                raise GpuaccelError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        try:
            self.size_schedule = [f"{size}:{epochs:g}" for size, epochs in parse_size_schedule(self.size_schedule)] \
                or None
        except ValueError as exc:
            raise GpuaccelError(f"--size-schedule: {exc}") from None
        if self.workers is not None and (not isinstance(self.workers, int) or self.workers < 0):
            raise GpuaccelError(f"--workers must be a whole number >= 0, got {self.workers}")
        check_whole(self, "context")
        if self.vocab_size is not None:
            check_whole(self, "vocab_size")


def _data_settings() -> type:
    """The data section: :class:`CommonDataSettings` and every registered data kind's own settings
    (``DataKind.options``), each kind validating its own values. Made when this module is first
    imported, from the kinds registered by then (the built-in ones, gpuaccel/kinds/)."""
    from ..data.kinds import kind_options

    owned = kind_options()
    fields = [(f.name, hint, dataclasses.field(
        **(dict(default=f.default) if f.default is not dataclasses.MISSING else dict(default_factory=f.default_factory)),
        metadata=f.metadata)) for _, f, hint in owned]
    kinds = list(dict.fromkeys(kind for kind, _, _ in owned))

    def validate(self) -> None:
        CommonDataSettings.validate(self)
        for kind in kinds:
            kind.validate_options(self)

    cls = dataclasses.make_dataclass(
        "DataSettings", fields, bases=(CommonDataSettings,),
        namespace={"validate": validate, "__doc__": "What is read, and how it reaches the device: the settings of "
                   "every kind of data (CommonDataSettings) and each kind's own (DataKind.options)."})
    cls.__module__ = __name__  # (pickled and named as this module's)
    return cls


DataSettings = _data_settings()


@dataclass
class ModelSettings:
    """What is trained, for which task."""
    name: str | None = setting(
        None, "a registered model ('gpuaccel models' lists them: lenet5, mlp, resnet18, resnet34, "
        "resnet50, mobilenet_v2, fastnet, ...), package.module:factory for your own (found from the current "
        "directory), or timm:NAME when timm is installed. Default: the data's own: lenet5 for images, gpt for "
        "text, text_transformer for sentences, audio_tcnn for recordings, matrix_factorization for ratings, "
        "centernet for detection, unet for segmentation, transformer_seq2seq for translation", metavar="NAME",
        flag="model")
    model_path: str | None = setting(None, "where package.module:factory was imported from (recorded)",
                                     cli=False)
    model_args: dict | None = setting(
        None, "keyword arguments for the model factory beyond what the data gives (e.g. "
        "layers=6,heads=6,width=384,dropout=0.2 for gpt)", metavar="K=V,...")
    task: str | None = setting(None, "classification, multilabel, regression, language_modelling, ranking, "
                                              "detection, segmentation or translation (default: the data's own: classification "
                                              "for images and recordings, language_modelling for text, regression "
                                              "for ratings, detection for COCO or YOLO folders, segmentation for "
                                              "mask folders; ranking: top-k recommendation from ratings as implicit "
                                              "feedback)",
                               choices=tuple(TASKS), metavar="NAME")
    activation_checkpointing: bool = setting(
        False, "recompute each block's activations in the backward pass instead of keeping them: less "
        "memory for about one more forward pass of compute")

    def validate(self) -> None:
        # a model name is checked when the model is built (the registry lists the valid ones)
        if self.model_args is not None and not (isinstance(self.model_args, dict) and
                                                all(isinstance(k, str) for k in self.model_args)):
            raise GpuaccelError(f"--model-args is a mapping of keyword: value, got {self.model_args!r}")


@dataclass
class RuntimeSettings:
    """Where, how precisely, how compiled."""
    device: str = setting("auto", "auto (a CUDA GPU if there is one), cpu, cuda or cuda:N",
                          metavar="DEV")
    precision: str = setting("auto", "auto (bf16 on GPUs that have it, fp16 on older GPUs, fp32 on "
                                                "the CPU), fp32, tf32 (fp32 with TF32 matrix multiplies), bf16 or "
                                                "fp16", choices=PRECISIONS, metavar="P")
    channels_last: bool | None = setting(None, "NHWC memory layout (default: on for GPUs, for "
                                                          "models with convolutions)")
    compile: bool = setting(False, "torch.compile the model (slower start, faster steps; compiled "
                                              "kernels are cached on disk)")
    compile_mode: str = setting(
        "default", "torch.compile mode: default, reduce-overhead (CUDA graphs), max-autotune, "
        "max-autotune-no-cudagraphs, or tuned (default with inductor's kernels tuned: minutes more compiling "
        "once per machine, for faster steps; docs/training.md)", choices=COMPILE_MODES, metavar="MODE")
    compile_regions: bool = setting(
        False, "with --compile: compile a model's repeated block (a transformer's layer) once for all its "
        "copies instead of the whole model: a first compile several times shorter; what lies between the blocks "
        "runs eagerly (inside the step's CUDA graph where the step is captured)")
    compile_background: bool = setting(
        True, "with --compile and the whole step as one CUDA graph (--compile-mode reduce-overhead, one GPU): "
        "a run whose compiled kernels this machine has not cached yet, and that would train in under a minute "
        "uncompiled, trains uncompiled (its step still one CUDA graph) while a process in the background compiles "
        "them for the runs after it; off: the run waits for its compile (docs/training.md)")
    compile_eval: bool = setting(
        True, "with --compile: compile the evaluation pass too (off: it runs eagerly, which spares "
        "tracing and loading a second graph: worth it for runs that evaluate once)")
    cudnn_benchmark: bool = setting(
        True, "on GPUs: cuDNN times its candidate algorithms for each new convolution shape, in every "
        "process, and keeps the fastest (off: its heuristics choose, sparing the search in short runs); always "
        "off with --deterministic")
    tune_kernels: bool = setting(
        False, "with --compile: tune the launch parameters of each kernel inductor generates (coordinate "
        "descent): a few percent faster steps for a minute or more of compiling, once per machine (torch 2.11 "
        "tunes again in every run: PyTorch issue 172819, fixed in 2.13)")
    step_graph: bool = setting(
        True, "with --compile-mode reduce-overhead on GPUs: capture the whole training step (forward, "
        "backward, gradient all-reduce with --gpus, optimizer, weight average) as one CUDA graph where the step "
        "allows it")
    deterministic: bool = setting(
        False, "deterministic GPU kernels (cuDNN without autotuning, deterministic cuBLAS): the same "
        "seed gives the same weights, and a resumed run those of an uninterrupted one, on a GPU as on the CPU; "
        "slower")

    def validate(self) -> None:
        # the device is checked when it is resolved (whether it exists is known only then)
        self.precision = precision_name(self.precision)  # one spelling: 'bfloat16' and torch.bfloat16 are bf16

    @property
    def captures_step(self) -> bool:
        """Compiled in reduce-overhead mode: the step (or the model) runs as CUDA graphs."""
        return self.compile and self.compile_mode == "reduce-overhead"


@dataclass
class ParallelSettings:
    """Several processes (started by --gpus or torchrun)."""
    sync_bn: bool = setting(False, "several processes: batch-norm statistics over the global batch "
                                               "(SyncBatchNorm, GPUs)")
    ddp_bucket_mb: float = setting(25.0, "several processes: gradient all-reduce bucket size",
                                   metavar="MB")
    overlap_gradients: bool = setting(
        False, "several processes with the step graph: average the gradients in --ddp-bucket-mb buckets "
        "while the backward pass runs (the model compiled in pieces: slightly faster steps, seconds more warm-up; "
        "docs/parallel.md); off: one all-reduce after it")
    shard: bool = setting(False, "fully sharded data parallel (FSDP): each process keeps 1/N of the "
                                             "parameters, gradients and optimizer state; checkpoints stay whole")
    shard_unit_mb: float = setting(80.0, "with --shard: consecutive blocks are sharded together until "
                                                     "a unit holds this many MB of parameters (each unit costs host "
                                                     "work every step; 0: a unit per block)", metavar="MB")
    offload: str = setting("none", "with --shard: 'cpu' keeps parameters, gradients and optimizer "
                                               "state in host memory and runs the optimizer step on the CPU",
                           choices=("none", "cpu"), metavar="WHERE")
    pipeline_stages: int = setting(1, "split the model into S stages on S processes "
                                                  "(torch.distributed.pipelining); with --gpus N, N/S pipelines "
                                                  "train data parallel", metavar="S")
    microbatches: int | None = setting(None, "with --pipeline-stages: micro-batches per batch "
                                                         "(default: the fewest, at least max(4, 2 x stages), that "
                                                         "divide the batch evenly)", metavar="M")
    pipeline_schedule: str = setting("1f1b", "with --pipeline-stages: the schedule",
                                     choices=PIPELINE_SCHEDULES, metavar="NAME")
    split_points: list[str] | None = setting(None, "with --pipeline-stages: the modules each new "
                                                               "stage starts at (default: chosen to even out the "
                                                               "stages' FLOPs)", metavar="A,B")

    def validate(self) -> None:
        check_whole(self, "pipeline_stages")
        if not self.ddp_bucket_mb > 0:
            raise GpuaccelError(f"--ddp-bucket-mb must be positive, got {self.ddp_bucket_mb}")
        if not self.shard_unit_mb >= 0:
            raise GpuaccelError(f"--shard-unit-mb must be 0 or more, got {self.shard_unit_mb}")
        if self.shard and self.sync_bn:
            raise GpuaccelError("--sync-bn is for data parallel without --shard")
        if self.offload == "cpu" and not self.shard:
            raise GpuaccelError("--offload cpu works with --shard (FSDP moves each block's parameters to the GPU "
                                "when it runs); add --shard")
        if self.microbatches is not None and (not isinstance(self.microbatches, int) or self.microbatches < 1):
            raise GpuaccelError(f"--microbatches must be a whole number >= 1, got {self.microbatches}")
        if self.pipeline_stages == 1 and (self.microbatches is not None or self.split_points is not None):
            raise GpuaccelError("--microbatches and --split-points are for --pipeline-stages 2 or more")
        if self.split_points is not None and len(self.split_points) != self.pipeline_stages - 1:
            raise GpuaccelError(f"--split-points names {len(self.split_points)} module(s); "
                                f"{self.pipeline_stages} stages need {self.pipeline_stages - 1}")

    def microbatches_of(self, batch_size: int) -> int:
        """--microbatches, or the fewest that divide the batch evenly and number at least
        max(4, 2 x stages) (fewer leave the stages idle longer at the start and end of a step)."""
        if self.microbatches:
            return self.microbatches
        least = max(4, 2 * self.pipeline_stages)
        return next((m for m in range(least, batch_size + 1) if batch_size % m == 0), batch_size)


@dataclass
class OptimizerSettings:
    """How the weights move."""
    name: str = setting("sgd", "sgd (Nesterov momentum), adamw, or muon (orthogonalised "
                                                 "updates for convolution filters, SGD for the rest)",
                             choices=("sgd", "adamw", "muon"), metavar="NAME", flag="optimizer")
    lr: float = setting(0.05, "peak learning rate")
    momentum: float = setting(0.9, "SGD momentum or AdamW beta1")
    beta2: float = setting(0.999, "AdamW's second-moment decay")
    nesterov: bool = setting(True, "Nesterov momentum")
    weight_decay: float = setting(5e-4, "on weights, not on biases or norms")
    bias_lr_scale: float = setting(1.0, "learning-rate multiplier for biases and norm parameters",
                                   metavar="X")
    muon_lr: float = setting(0.24, "with --optimizer muon: the filters' learning rate")
    muon_momentum: float = setting(0.6, "with --optimizer muon: the filters' momentum")
    muon_ns_steps: int = setting(5, "with --optimizer muon: Newton-Schulz iterations per update "
                                                 "(fewer: a cheaper step, a rougher orthogonalisation)", metavar="K")
    schedule: str = setting("onecycle", "the learning-rate schedule: onecycle, cosine (with "
                                                     "warm-up) or constant",
                            choices=("onecycle", "cosine", "constant"), metavar="NAME")
    warmup_epochs: float = setting(1.0, "length of the rising part of the schedule")
    label_smoothing: float = setting(0.0, "classification: the share of each target spread over "
                                                       "all classes")
    grad_accum: int = setting(1, "accumulate K batches per optimizer step (effective batch = K x "
                                              "batch size)", metavar="K")
    grad_clip: float | None = setting(None, "clip the gradient norm to NORM", metavar="NORM")
    ema: float | None = setting(None, "evaluate an exponential moving average of the weights "
                                                   "(e.g. 0.99 per step)", metavar="DECAY")

    def validate(self) -> None:
        check_whole(self, "grad_accum")
        check_whole(self, "muon_ns_steps")
        for name in ("lr", "muon_lr", "bias_lr_scale"):
            if not getattr(self, name) > 0:
                raise GpuaccelError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        for name in ("momentum", "beta2", "muon_momentum", "label_smoothing"):
            if not 0 <= getattr(self, name) < 1:
                raise GpuaccelError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        for name in ("weight_decay", "warmup_epochs"):
            _at_least(self, name, 0)
        if self.ema is not None and not 0 < self.ema < 1:
            raise GpuaccelError(f"--ema is a decay in (0, 1) (e.g. 0.99), got {self.ema}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise GpuaccelError(f"--grad-clip must be positive, got {self.grad_clip}")

    def build(self, model):
        """The optimizer these settings describe, over ``model``'s trained parameters
        (train/optim.py: which parameters decay at which rate, Muon's filters); give it to
        ``Accelerator.prepare_optimizer`` for its kernels on the device."""
        from .optim import build_optimizer

        return build_optimizer(model, self)

    def build_with_schedule(self, model, epochs: float, steps_per_epoch: int):
        """(:meth:`build`'s optimizer, its learning-rate schedule over ``epochs`` of
        ``steps_per_epoch`` optimizer steps): the section's two components, made together."""
        from .optim import build_scheduler

        optimizer = self.build(model)
        return optimizer, build_scheduler(optimizer, self, epochs, steps_per_epoch)


@dataclass
class LoopSettings:
    """Batches, evaluation and when to stop."""
    batch_size: int = setting(128, "samples per step (per process; with --global-batch, of all processes "
                                           "together)")
    global_batch: bool = setting(False, "--batch-size is the batch of all processes together, each taking "
                                                "an equal share: the run keeps its batch, learning rate and "
                                                "accuracy on any number of GPUs (strong scaling)")
    eval_batch_size: int = setting(1024, "samples per evaluation batch")
    seed: int = setting(0, "seeds model init, data order and augmentation")
    tta: int = setting(0, "test-time augmentation: 0 none, 1 flip, 2 flip and one-pixel translations "
                                  "(classification; segmentation takes 0 or 1)", metavar="LEVEL")
    epochs: float = setting(10, "passes over the training set (a fraction stops inside the last one)")
    time_limit: float | None = setting(None, "stop training so that its time and the final evaluation "
                                                     "(reckoned as long as the last one) fit in SECONDS",
                                       metavar="SECONDS")
    target: str | None = setting(None, "stop as soon as the held-out METRIC reaches VALUE (e.g. "
                                               "accuracy=0.99, or loss=0.05: lower is better for losses and "
                                               "errors); records the time to it", metavar="METRIC=VALUE")
    target_acc: float | None = setting(None, "the same as --target accuracy=F", metavar="F")
    beam_size: int = setting(5, "translation: hypotheses kept by the beam search that decodes the held-out "
                                        "sentences (1: greedy)", metavar="K")
    length_penalty: float = setting(1.0, "translation: the beam search ranks hypotheses by log-probability / "
                                                 "length ** P", metavar="P")
    eval_every: int | None = setting(None, "evaluate every STEPS optimizer steps (default: each epoch)",
                                     metavar="STEPS")

    def validate(self) -> None:
        for name in ("batch_size", "eval_batch_size"):
            check_whole(self, name)
        if self.tta not in (0, 1, 2):
            raise GpuaccelError(f"--tta must be 0 (none), 1 (flip) or 2 (flip and translate), got {self.tta}")
        if isinstance(self.epochs, bool) or not isinstance(self.epochs, (int, float)) or not self.epochs > 0:
            raise GpuaccelError(f"--epochs must be a positive number, got {self.epochs}")
        if self.time_limit is not None and self.time_limit <= 0:
            raise GpuaccelError(f"--time-limit must be positive, got {self.time_limit}")
        if self.eval_every is not None:
            check_whole(self, "eval_every")
        check_whole(self, "beam_size")
        if not self.length_penalty >= 0:
            raise GpuaccelError(f"--length-penalty must be >= 0, got {self.length_penalty}")
        if self.target_acc is not None:
            if not 0 < self.target_acc <= 1:
                raise GpuaccelError(f"--target-acc is a fraction in (0, 1] (e.g. 0.99), got {self.target_acc}")
            alias = f"accuracy={self.target_acc:g}"
            if self.target is not None and parse_target(self.target) != parse_target(alias):
                raise GpuaccelError(f"--target {self.target} and --target-acc {self.target_acc:g} disagree; give one")
            self.target, self.target_acc = alias, None
        if self.target is not None:
            parse_target(self.target)

    @property
    def target_metric(self) -> tuple[str, float] | None:
        """(metric, value) of ``target``, or None."""
        return None if self.target is None else parse_target(self.target)

    def batch_per_process(self, data_ranks: int) -> int:
        """Samples per step of each of ``data_ranks`` processes that split the data."""
        if not self.global_batch:
            return self.batch_size
        if self.batch_size % data_ranks:
            raise GpuaccelError(f"--global-batch: --batch-size {self.batch_size} does not split evenly over "
                                f"{data_ranks} processes; give a multiple of {data_ranks}")
        return self.batch_size // data_ranks


@dataclass
class LoggingSettings:
    """What the run directory receives."""
    run_dir: str | None = setting(None, "where to save the run (default runs/<data>-<model>-<time>)",
                                  metavar="DIR")
    checkpoint_every: int | None = setting(None, "also checkpoint every STEPS steps (besides "
                                                            "--checkpoint-epochs and --checkpoint-seconds)",
                                           metavar="STEPS")
    checkpoint_seconds: float = setting(300.0, "checkpoint at least this often", metavar="SECONDS")
    checkpoint_epochs: int = setting(1, "checkpoint at the end of every N-th epoch (0: by steps and "
                                                   "seconds only, for epochs of a step or two)", metavar="N")
    monitor: bool = setting(True, "sample GPU utilisation, memory, power, temperature and clock every "
                                             "0.1 s into gpu.jsonl (needs nvidia-ml-py)")
    profile: bool = setting(False, "write a torch.profiler trace of a few steps (--profile-steps) to "
                                              "profile/trace.json and an operator table")
    profile_steps: str = setting("8-12", "with --profile: the steps traced, FIRST-LAST (counted from 1; "
                                                    "the two before are run under the profiler untraced)",
                                 metavar="FIRST-LAST")
    tensorboard: bool = setting(False, "log the metrics as TensorBoard scalars in tensorboard/ (needs "
                                                  "tensorboard)")

    def validate(self) -> None:
        _at_least(self, "checkpoint_seconds", 0)
        check_whole(self, "checkpoint_epochs", minimum=0)
        if self.checkpoint_every is not None:
            check_whole(self, "checkpoint_every")
        _step_range(self.profile_steps)

    @property
    def profile_window(self) -> tuple[int, int]:
        """(first, last) step that ``--profile`` traces, counted from 1."""
        return _step_range(self.profile_steps)


SECTIONS = {"data": DataSettings, "model": ModelSettings, "runtime": RuntimeSettings, "parallel": ParallelSettings,
            "optimizer": OptimizerSettings, "loop": LoopSettings, "logging": LoggingSettings}


@dataclass(frozen=True)
class Setting:
    """One setting of the schema: its flat name, its section and field there, its type and the
    declaration (default, help, choices)."""
    flat: str
    section: str
    name: str
    type: type
    field: dataclasses.Field

    @property
    def default(self):
        f = self.field
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _schema() -> dict[str, Setting]:
    schema = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = next((t for t in typing.get_args(hints[f.name]) if t is not type(None)), hints[f.name])
            flat = f.metadata["flag"] or f.name
            schema[flat] = Setting(flat, section, f.name, kind, f)
    return schema


SCHEMA: dict[str, Setting] = _schema()  # every setting, by flat name, in declaration order


class TrainConfig:
    """The settings of a training run: one object per section (``config.data``, ``config.model``,
    ``config.runtime``, ``config.parallel``, ``config.optimizer``, ``config.loop``,
    ``config.logging``).

    Built from sections, from flat settings as on the command line, or both::

        TrainConfig(epochs=10, batch_size=256, optimizer="adamw", lr=3e-3)
        TrainConfig(optimizer=OptimizerSettings(name="adamw", lr=3e-3), epochs=10)

    (``data``, ``model`` and ``optimizer`` given as a string are the flat settings: the data
    spec, the model's name, the optimizer's name.)
    """

    data: DataSettings
    model: ModelSettings
    runtime: RuntimeSettings
    parallel: ParallelSettings
    optimizer: OptimizerSettings
    loop: LoopSettings
    logging: LoggingSettings

    def __init__(self, **settings):
        for section, cls in SECTIONS.items():
            given = settings.get(section)
            if isinstance(given, cls):
                settings.pop(section)
                setattr(self, section, copy.deepcopy(given))
            elif isinstance(given, dict):
                settings.pop(section)
                setattr(self, section, cls(**_section_fields(section, given)))
            else:
                setattr(self, section, cls())
        self._set_flat(settings)

    def _set_flat(self, settings: dict) -> None:
        _refuse_unknown(settings)
        for flat, value in settings.items():
            s = SCHEMA[flat]
            setattr(getattr(self, s.section), s.name, value)

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return "TrainConfig(" + ", ".join(f"{section}={getattr(self, section)!r}" for section in SECTIONS) + ")"

    def validate(self) -> "TrainConfig":
        """Checks every section (its own values, then how they combine); raises GpuaccelError
        naming the first bad value and the valid ones."""
        for s in SCHEMA.values():  # the named choices, for every section at once
            choices, value = s.field.metadata["choices"], self.get(s.flat)
            if s.flat == "precision":
                continue  # (read by RuntimeSettings.validate, which knows its other spellings)
            if choices and value is not None and value not in choices:
                raise choice_error(s.flat.replace("_", " "), value, choices)
        for section in SECTIONS:
            getattr(self, section).validate()
        self._validate_combinations()
        return self

    def _validate_combinations(self) -> None:
        parallel, optimizer = self.parallel, self.optimizer
        if parallel.shard and optimizer.ema is not None:
            raise GpuaccelError("--ema is not supported with --shard (the weight average would not be sharded)")
        if optimizer.name == "muon" and parallel.shard:
            raise GpuaccelError("--optimizer muon needs each filter bank whole and does not work with --shard; "
                                "use sgd or adamw")
        if parallel.pipeline_stages > 1:
            if self.loop.batch_size % self.pipeline_microbatches:
                raise GpuaccelError(f"--batch-size {self.loop.batch_size} does not split into "
                                    f"{self.pipeline_microbatches} equal micro-batches; change --batch-size or "
                                    f"--microbatches")
            unsupported = {"--shard": parallel.shard, "--ema": optimizer.ema is not None, "--sync-bn": parallel.sync_bn,
                           "--grad-accum (use --microbatches)": optimizer.grad_accum > 1,
                           "--precision fp16": self.runtime.precision == "fp16",
                           "--compile-mode reduce-overhead (CUDA graphs)": self.runtime.captures_step}
            for option, used in unsupported.items():
                if used:
                    raise GpuaccelError(f"{option} is not supported with --pipeline-stages")

    @property
    def pipeline_microbatches(self) -> int:
        """Micro-batches per batch of a pipelined run (ParallelSettings.microbatches_of)."""
        return self.parallel.microbatches_of(self.loop.batch_size)

    def get(self, flat: str):
        """A setting by its flat name (``config.get("lr")`` is ``config.optimizer.lr``)."""
        s = SCHEMA[flat]
        return getattr(getattr(self, s.section), s.name)

    def flat(self) -> dict:
        """Every setting by its flat name: the form of the command line and flat recipes."""
        return {flat: copy.deepcopy(self.get(flat)) for flat in SCHEMA}

    def to_dict(self) -> dict[str, dict]:
        """The settings by section ({"data": {...}, "model": {...}, ...}): config.json's form, and
        a recipe's nested form."""
        return {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}

    @classmethod
    def from_dict(cls, values: dict) -> "TrainConfig":
        """Builds a config from a recipe or a saved config.json, flat or nested by section;
        unknown keys are errors."""
        return cls(**flatten_sections(values))

    def replace(self, **changes) -> "TrainConfig":
        """A copy with ``changes``: flat settings, or whole sections."""
        sections = {k: v for k, v in changes.items() if isinstance(v, SECTIONS.get(k, ()))}
        config = TrainConfig(**{section: sections.get(section, getattr(self, section)) for section in SECTIONS})
        config._set_flat({k: v for k, v in changes.items() if k not in sections})
        return config


def _section_fields(section: str, values: dict) -> dict:
    """A section's mapping as its fields' names: a key may be the field's name or its flat name."""
    cls = SECTIONS[section]
    by_flat = {s.flat: s.name for s in SCHEMA.values() if s.section == section}
    names = {f.name for f in dataclasses.fields(cls)}
    fields, wrong = {}, []
    for key, value in values.items():
        name = key if key in names else by_flat.get(key)
        if name is None:
            wrong.append(key)
        else:
            fields[name] = value
    if wrong:
        raise GpuaccelError(f"section {section} has no setting(s) {', '.join(sorted(wrong))}; it has: "
                            f"{', '.join(by_flat)}")
    return fields


def flatten_sections(values: dict) -> dict:
    """A recipe's or config.json's settings as flat names: a section's mapping ({"optimizer":
    {"lr": 0.1}}) is opened, and every key is checked against the schema."""
    flat = _opened(values, check=True)
    _refuse_unknown(flat)
    return flat


def _refuse_unknown(settings: dict) -> None:
    unknown = sorted(set(settings) - set(SCHEMA))
    if unknown:
        raise GpuaccelError(f"unknown training setting(s) {', '.join(unknown)}; valid ones: "
                            f"{', '.join(sorted(SCHEMA))}")


def saved_settings(values: dict) -> dict:
    """The flat settings of a run's saved configuration (a checkpoint's "config", config.json),
    nested or, from runs before the nested config, flat; keys no longer in the schema are kept,
    not refused (reading an old run's data spec must not fail on a retired setting)."""
    return _opened(values, check=False)


def _opened(values: dict, check: bool) -> dict:
    """``values`` with each section's mapping opened into flat names (``check``: a key a section
    does not have is an error)."""
    flat = {}
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            names = {s.name: s.flat for s in SCHEMA.values() if s.section == key}
            fields = _section_fields(key, value) if check else value
            flat.update({names.get(k, k): v for k, v in fields.items()})
        else:
            flat[key] = value
    return flat


def _step_range(text) -> tuple[int, int]:
    """Text FIRST-LAST -> (FIRST, LAST), steps counted from 1; a user error for anything else."""
    first, _, last = str(text).partition("-")
    if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise GpuaccelError(f"--profile-steps is FIRST-LAST with 1 <= FIRST <= LAST (e.g. 8-12), got {text}")
    return int(first), int(last)


def _at_least(config, name: str, low: float) -> None:
    if getattr(config, name) < low:
        raise GpuaccelError(f"--{name.replace('_', '-')} must be >= {low:g}, got {getattr(config, name)}")


def parse_target(text: str) -> tuple[str, float]:
    """'accuracy=0.99' -> ('accuracy', 0.99); a bare number means accuracy; val_loss (or
    test_loss) is the held-out loss, which evaluations record as 'loss'."""
    name, sep, value = str(text).partition("=")
    if not sep:
        name, value = "accuracy", name
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not name.strip() or number != number:
        raise GpuaccelError(f"--target is METRIC=VALUE (e.g. accuracy=0.99 or val_loss=1.47), got {text!r}")
    name = name.strip()
    return ("loss" if name in LOSS_ALIASES else name), number
