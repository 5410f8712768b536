"""Data kinds as plug-ins: what each kind of data brings, found by name or by looking at a path.

A kind (images, detection and segmentation scenes, a text corpus, labelled sentences,
recordings, ratings, sentence pairs for translation) is one :class:`DataKind` object in one
file under ``gpuaccel/kinds/``, registered with :func:`register_kind`, in the way timm registers
models and torchtitan its train specs. It brings its reader (``detect`` and ``open``, which
returns the trainer's ``TrainingInputs``: the loaders, the defaults, what a checkpoint
records), and what deployment asks of a run of its kind (``export``, ``held_out``,
``read_inputs``). Everything that used to ask "which kind is this?" in an if-chain asks the
registry once.

The built-in kinds are registered on the first lookup (``gpuaccel.kinds`` imports each of
them), as a package's entry points would be: importing ``gpuaccel`` or ``gpuaccel.data`` loads
none of them; ``gpuaccel.train``'s config does, to make the data section from the settings each
kind declares as its own (``DataKind.options``), so a kind imports ``gpuaccel.train`` inside
its methods only. A kind of a user's own is registered by calling :func:`register_kind` before
training; ``--data NAME:PATH`` then reaches it.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import typing
from pathlib import Path

from ..errors import GpuaccelError, choice_error

BUILTIN_KINDS = "gpuaccel.kinds"  # the package whose import registers the built-in kinds

_KINDS: dict[str, "DataKind"] = {}
_loaded = False


class DataKind:
    """What one kind of data brings. ``name`` is what ``--data NAME:PATH`` says and what a run
    records; ``formats`` are further names of formats it reads (an image kind: mnist, cifar10,
    ...). ``detect_order``: kinds are asked in this order which of them a path is (the first to
    answer wins), so specific layouts come before general ones."""

    name = ""
    formats: tuple[str, ...] = ()
    detect_order = 100
    description = ""  # one line for --data's help: what it reads
    # the model and task a run of this kind takes when none is named (shown in --model's help)
    default_model: str | None = None
    default_task: str | None = None
    export_format = "onnx"  # what 'gpuaccel export' writes when no --format is given
    # the data settings it shares with other kinds (flat names, e.g. "tokenizer") and reads beyond
    # those of every kind (source, val_split, cache_dir)
    settings: tuple[str, ...] = ()
    # the settings only this kind reads, declared with it: a dataclass of gpuaccel.settings.setting
    # fields, joined to the data section (train/config.py: DataSettings) as --flags and recipe keys
    options: type | None = None

    @property
    def option_group(self) -> tuple[str, ...]:
        """Every data setting this kind reads beyond every kind's: ``settings`` and its ``options``.
        One of another kind's group given for this kind's data is refused in one line rather than
        silently ignored."""
        own = tuple(f.name for f in dataclasses.fields(self.options)) if self.options is not None else ()
        return self.settings + own

    def validate_options(self, data) -> None:
        """One-line errors for bad values of this kind's ``options`` in the data section ``data``
        (checked for every run, as every section's values are)."""

    def detect(self, path: Path) -> str | None:
        """The format of this kind found at ``path`` (``name`` or one of ``formats``), or None."""
        return None

    def open(self, config, path: Path | None, fmt: str, *, dist=None):
        """The trainer's ``TrainingInputs`` for ``path`` (read as ``fmt``) under ``config``;
        ``dist``: the process group, whose rank 0 reads (and caches) first."""
        raise NotImplementedError

    # -- what deployment asks of a run of this kind (its checkpoint state)

    def owns_run(self, state: dict) -> bool:
        """Whether a run (its checkpoint state) trained on data of this kind: the kind it recorded,
        or for a run from before kinds were recorded, what its checkpoint holds."""
        if "data_kind" in state:
            return state["data_kind"] == self.name
        return self.owned_before_kinds(state)

    def owned_before_kinds(self, state: dict) -> bool:
        """Whether a checkpoint that recorded no kind is of this kind (by its tokeniser, task, ...)."""
        return False

    def export(self, run, fmt: str, out, *, data, verify_count: int, static_batch, opset):
        """Exports the run and verifies the artefact: (the report, what was compared)."""
        raise GpuaccelError(f"'gpuaccel export' does not take runs on {self.name} data")

    def held_out(self, run, data, why: str):
        """The run's data as its deployed model takes it (``deploy.heldout.HeldOut``): for int8
        calibration and accuracy (quantize, prune, bench-infer)."""
        raise GpuaccelError(f"{run} was trained on {self.name} data: 'gpuaccel export' and 'gpuaccel infer' take "
                            f"it; quantize, prune and bench-infer work on classifiers")

    def read_inputs(self, runner, inputs: list[str], skip_bad: bool = False):
        """What 'gpuaccel infer' predicts for (``deploy.infer.ModelInputs``)."""
        raise GpuaccelError(f"'gpuaccel infer' does not take runs on {self.name} data")


def register_kind(kind: DataKind) -> DataKind:
    """Adds ``kind`` to the registry (replacing one of the same name); returns it."""
    if not kind.name:
        raise GpuaccelError(f"a data kind needs a name ({type(kind).__name__} has none)")
    # a kind's own settings join the data section when train/config.py is first imported (its SCHEMA
    # then exists): a kind registered after that may read existing settings only
    schema = getattr(sys.modules.get("gpuaccel.train.config"), "SCHEMA", None)
    own = [f.name for f in dataclasses.fields(kind.options)] if kind.options is not None else []
    if schema is not None and any(name not in schema for name in own):
        raise GpuaccelError(f"data kind {kind.name}: settings of its own ({', '.join(own)}) join the data section "
                            f"when gpuaccel.train is first imported; register it before that, or read the settings "
                            f"that exist")
    _KINDS[kind.name] = kind
    return kind


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        importlib.import_module(BUILTIN_KINDS)


def data_kinds() -> list[DataKind]:
    """Every registered kind, in the order they are asked which a path is."""
    _load_builtin()
    return sorted(_KINDS.values(), key=lambda k: k.detect_order)


def setting_kinds() -> dict[str, tuple[str, ...]]:
    """Each data setting in some kind's option group (``DataKind.option_group``), and the kinds
    whose group it is in, in registry order; settings of every kind (source, val_split, ...) are
    not here."""
    kinds = data_kinds()
    names = dict.fromkeys(name for kind in kinds for name in kind.option_group)
    return {name: tuple(kind.name for kind in kinds if name in kind.option_group) for name in names}


def kind_options() -> list[tuple[DataKind, dataclasses.Field, type]]:
    """(kind, field, its type) for each setting a registered kind declares as its own
    (``DataKind.options``), in registry order; a name two kinds declare is an error."""
    found, owner = [], {}
    for kind in data_kinds():
        if kind.options is None:
            continue
        hints = typing.get_type_hints(kind.options)
        for f in dataclasses.fields(kind.options):
            if f.name in owner:
                raise GpuaccelError(f"data kinds {owner[f.name]} and {kind.name} both declare the setting {f.name}; "
                                    f"a setting two kinds read belongs to train/config.py's CommonDataSettings")
            owner[f.name] = kind.name
            found.append((kind, f, hints[f.name]))
    return found


def spec_names() -> dict[str, DataKind]:
    """Every name ``--data NAME:PATH`` takes, and the kind that reads it."""
    return {name: kind for kind in data_kinds() for name in (kind.name, *kind.formats)}


def kind_named(name: str) -> DataKind:
    """The kind that reads ``name`` (a kind's name or one of its formats)."""
    names = spec_names()
    if name not in names:
        raise choice_error("data kind", name, sorted(names))
    return names[name]


def find_kind(path: Path) -> tuple[DataKind, str]:
    """(the kind, the format) of what is at ``path``, asking each kind in its order; an error
    names what was looked for when none recognises it."""
    for kind in data_kinds():
        found = kind.detect(path)
        if found is not None:
            return kind, found
    raise GpuaccelError(f"cannot tell what data {path} holds; name its kind: --data KIND:{path} with KIND one of "
                        f"{', '.join(sorted(spec_names()))}")


def kind_of_run(state: dict) -> DataKind | None:
    """The kind of data a run (its checkpoint state) trained on; None for a run of a user's own
    data from Python."""
    for kind in data_kinds():
        if kind.owns_run(state):
            return kind
    return None
