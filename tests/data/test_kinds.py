"""Data kinds as plug-ins: the registry finds each built-in kind by name and by what is at a path,
and a kind of a user's own is one class plus its registration, with nothing else changed."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from gpuaccel.data import kinds, parse_spec
from gpuaccel.data.kinds import DataKind, data_kinds, find_kind, kind_named, kind_of_run, register_kind
from gpuaccel.errors import GpuaccelError
from gpuaccel.runtime.loaders import ResidentLoader
from gpuaccel.train import TrainConfig, Trainer
from gpuaccel.train.inputs import TrainingInputs


class Bits(DataKind):
    """A toy kind: a ``.bits`` file of rows ``a b label`` (label = a xor b), its last fifth held out."""

    name = "bits"
    detect_order = 5

    def detect(self, path: Path):
        return self.name if path.suffix == ".bits" else None

    def open(self, config, path, fmt, *, dist=None):
        rows = np.loadtxt(path, dtype=np.float32).reshape(-1, 3)
        x, y = torch.from_numpy(rows[:, :2]), torch.from_numpy(rows[:, 2]).long()
        cut = len(rows) * 4 // 5

        def build(config, *, device, dtype, channels_last, rank, world_size):
            common = dict(device=device, seed=config.loop.seed, rank=rank, world_size=world_size)
            return (ResidentLoader((x[:cut], y[:cut]), batch_size=config.loop.batch_size, train=True, **common),
                    ResidentLoader((x[cut:], y[cut:]), batch_size=config.loop.eval_batch_size, train=False, **common))

        return TrainingInputs(name=path.stem, description=f"{path.stem}: {len(rows)} rows of bits",
                              train_samples=cut, test_samples=len(rows) - cut, classes=["0", "1"],
                              task="classification", unit="rows", identity={"rows": len(rows)}, build=build)


@pytest.fixture
def bits_kind(monkeypatch):
    data_kinds()  # (the built-in kinds first, so that the registry is whole before the toy one joins)
    kind = Bits()
    monkeypatch.setitem(kinds._KINDS, kind.name, kind)
    return kind


def test_every_built_in_kind_is_registered_and_found_by_each_of_its_names():
    names = {kind.name for kind in data_kinds()}
    assert names == {"audio", "images", "ratings", "scenes", "sentences", "text", "translation"}
    for name in ("mnist", "cifar10", "imagefolder", "npz", "tar", "digits"):
        assert kind_named(name).name == "images"
    for name in ("coco", "yolo", "masks"):
        assert kind_named(name).name == "scenes"
    with pytest.raises(GpuaccelError, match="unknown data kind 'bogus'"):
        kind_named("bogus")


def test_a_path_nothing_recognises_is_one_error_naming_the_kinds(tmp_path):
    odd = tmp_path / "data.weird"
    odd.write_text("?")
    with pytest.raises(GpuaccelError, match=r"cannot tell the format of this file"):
        find_kind(odd)


def test_a_kind_of_ones_own_is_a_class_and_its_registration(tmp_path, bits_kind):
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2, (400, 2))
    path = tmp_path / "xor.bits"
    np.savetxt(path, np.column_stack([bits, bits[:, 0] ^ bits[:, 1]]), fmt="%d")
    assert parse_spec(str(path)) == ("bits", path) and parse_spec(f"bits:{path}") == ("bits", path)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2))
    config = TrainConfig(data=str(path), epochs=30, batch_size=32, lr=0.1, optimizer="sgd", device="cpu",
                         monitor=False, run_dir=str(tmp_path / "run"))
    summary = Trainer(config, model=model, quiet=True).fit()
    assert summary["metrics"]["accuracy"] == 1.0 and summary["sample_unit"] == "rows"
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert state["data_kind"] == "bits" and kind_of_run(state) is bits_kind
    with pytest.raises(GpuaccelError, match="'gpuaccel export' does not take runs on bits data"):
        bits_kind.export(tmp_path / "run", "onnx", None, data=None, verify_count=10, static_batch=None, opset=None)


def test_a_kind_needs_a_name():
    class Nameless(DataKind):
        pass

    with pytest.raises(GpuaccelError, match="needs a name"):
        register_kind(Nameless())


RECIPE_KINDS = {"cifar10-accurate": "images", "cifar10-fast": "images", "digits": "images", "fsdd": "audio",
                "movielens": "ratings", "movielens-topk": "ratings", "multi30k": "translation",
                "gpt2-small": "text", "scenes-detect": "scenes", "scenes-segment": "scenes", "shakespeare-char": "text",
                "sst2": "sentences"}


def test_each_shipped_recipe_sets_only_its_kinds_settings():
    from gpuaccel.train.inputs import check_kind_settings
    from gpuaccel.train.recipes import list_recipes, load_recipe

    assert sorted(RECIPE_KINDS) == list_recipes()  # (a new recipe names its kind here)
    for recipe, kind in RECIPE_KINDS.items():
        check_kind_settings(kind_named(kind), TrainConfig.from_dict(load_recipe(recipe)))


def test_another_kinds_setting_is_one_line_and_this_kinds_own_are_taken():
    from gpuaccel.train.inputs import check_kind_settings

    owners = {name for kind in data_kinds() for name in kind.option_group}
    assert {"tokenizer", "sample_rate", "zoom", "source_lang", "negatives", "loader"} <= owners
    assert not owners & {"source", "val_split", "cache_dir"}  # (every kind's)
    text = kind_named("text")
    check_kind_settings(text, TrainConfig(data="tiny.txt", tokenizer="bpe", vocab_size=512, context=64))
    with pytest.raises(GpuaccelError, match=r"sample_rate is a setting of audio data; zoom is a setting of "
                                            r"scenes data, not of text data \(tiny.txt\); leave them out"):
        check_kind_settings(text, TrainConfig(data="tiny.txt", sample_rate=8000, zoom=0.2, tokenizer="bpe"))
    with pytest.raises(GpuaccelError, match="tokenizer is a setting of text and sentences data, not of translation"):
        check_kind_settings(kind_named("translation"), TrainConfig(data="pairs/", tokenizer="bpe"))


def test_training_refuses_a_setting_its_data_would_ignore(tmp_path, capsys):
    from conftest import assert_user_error

    assert_user_error(capsys, ["train", "--data", "digits", "--tokenizer", "bpe", "--epochs", "1", "--device", "cpu",
                               "--run-dir", str(tmp_path / "run")],
                      "--tokenizer is a setting of text and sentences data, not of images data (digits)")
    assert not (tmp_path / "run").exists()


def test_a_kinds_own_settings_are_declared_with_it_and_join_the_data_section():
    """#80: a kind brings its option group: the settings only it reads are declared in its file
    (``DataKind.options``) and become data settings: flags, recipe keys, checked values."""
    from gpuaccel.data.kinds import kind_options
    from gpuaccel.kinds.translation import TranslationOptions
    from gpuaccel.train.config import SCHEMA, CommonDataSettings

    translation = kind_named("translation")
    assert translation.options is TranslationOptions
    assert {"source_lang", "target_lang", "batch_tokens"} <= set(translation.option_group)
    own = {f.name: kind.name for kind, f, _ in kind_options()}
    assert own["batch_tokens"] == "translation" and own["zoom"] == "scenes" and own["sample_rate"] == "audio"
    common = {f.name for f in dataclasses.fields(CommonDataSettings)}
    assert all(SCHEMA[name].section == "data" and name not in common for name in own)
    config = TrainConfig.from_dict({"data": {"source": "pairs/", "batch_tokens": 2048, "source_lang": "de"}})
    assert config.data.batch_tokens == 2048 and config.to_dict()["data"]["source_lang"] == "de"
    with pytest.raises(GpuaccelError, match="batch_tokens must be a whole number >= 1, got 0"):
        TrainConfig(batch_tokens=0).validate()
    with pytest.raises(GpuaccelError, match="zoom must be in"):
        TrainConfig(zoom=1.5).validate()


def test_a_kind_registered_after_the_data_section_was_made_cannot_add_settings_to_it():
    @dataclasses.dataclass
    class LateOptions:
        window: int = 3

    class Late(DataKind):
        name = "late"
        options = LateOptions

    with pytest.raises(GpuaccelError, match="data kind late: settings of its own \\(window\\) join the data section "
                                            "when gpuaccel.train is first imported"):
        register_kind(Late())
    assert "late" not in [kind.name for kind in data_kinds()]
