"""One config schema, in sections: each setting declared once in its section; the CLI, recipes
and bench options made from it; flat settings, flat recipes and flat config.json files of older
runs still read."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest
import yaml

from gpuaccel import GpuaccelError, TrainConfig
from gpuaccel.cli import build_parser, main
from gpuaccel.train.config import (SCHEMA, SECTIONS, OptimizerSettings, flatten_sections,
                                   saved_settings)


def _help(*command: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return " ".join(out.getvalue().split())


def test_every_setting_is_an_option_with_help_in_its_section():
    text = _help("train")
    for s in SCHEMA.values():
        assert s.section in SECTIONS and s.field.metadata["help"], s.flat
        if s.field.metadata["cli"]:
            assert "--" + s.flat.replace("_", "-") in text, s.flat
    for section in SECTIONS:
        assert f"{section} settings:" in text


def test_print_config_is_a_recipe_that_gives_the_same_config(tmp_path, capsys):
    assert main(["train", "--recipe", "cifar10-fast", "--lr", "1.5", "--print-config"]) == 0
    printed = capsys.readouterr().out
    nested = yaml.safe_load(printed)
    assert list(nested) == list(SECTIONS) and nested["optimizer"]["lr"] == 1.5
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(printed)
    assert main(["train", "--recipe", str(recipe), "--print-config"]) == 0
    assert capsys.readouterr().out == printed
    expected = TrainConfig.from_dict({**flatten_sections(nested)}).validate()
    assert expected.model.name == "fastnet" and expected.optimizer.lr == 1.5
    assert nested["model"]["name"] == "fastnet" and nested["data"]["source"] == "digits"


def test_a_setting_in_the_wrong_section_is_a_one_line_error(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("optimizer:\n  epochs: 3\n")
    assert main(["train", "--recipe", str(recipe), "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert "section optimizer has no setting(s) epochs" in err and len(err.splitlines()) == 1
    with pytest.raises(GpuaccelError, match="unknown training setting"):
        TrainConfig.from_dict({"learning_rate": 0.1})


def test_bench_shares_the_training_options_with_its_own_defaults():
    text = _help("bench")
    declared = {s.flat: s.field.metadata["help"] for s in SCHEMA.values()}
    assert " ".join(declared["crop_padding"].split()) in text and "(default 4)" in text  # bench's default
    assert "--time-to-acc" in text and "--quick" in text


def test_a_value_outside_its_choices_names_them():
    with pytest.raises(GpuaccelError, match=r"unknown optimizer 'adam'; did you mean 'adamw'\? choose one of: sgd, adamw, muon"):
        TrainConfig(optimizer="adam").validate()


def test_the_config_is_nested_by_section_and_built_from_flat_settings_or_sections():
    config = TrainConfig(data="cifar10", model="resnet18", optimizer="adamw", lr=3e-3, epochs=4, shard_unit_mb=40.0)
    assert (config.data.source, config.model.name, config.optimizer.name) == ("cifar10", "resnet18", "adamw")
    assert (config.optimizer.lr, config.loop.epochs, config.parallel.shard_unit_mb) == (3e-3, 4, 40.0)
    assert config.get("lr") == 3e-3 and config.flat()["model"] == "resnet18"
    sections = TrainConfig(optimizer=OptimizerSettings(name="adamw", lr=3e-3), epochs=4, data="cifar10",
                           model="resnet18", shard_unit_mb=40.0)
    assert sections == config
    changed = config.replace(lr=0.1, batch_size=64)
    assert (changed.optimizer.lr, changed.loop.batch_size, config.optimizer.lr) == (0.1, 64, 3e-3)  # a copy
    assert config.replace(optimizer=OptimizerSettings(lr=0.5)).optimizer.lr == 0.5
    with pytest.raises(GpuaccelError, match="unknown training setting"):
        TrainConfig(learning_rate=0.1)


def test_config_json_is_nested_and_an_older_runs_flat_one_still_reads():
    config = TrainConfig(model="resnet18", lr=0.2, epochs=3).validate()
    nested = config.to_dict()
    assert list(nested) == list(SECTIONS) and nested["optimizer"]["lr"] == 0.2 and nested["model"]["name"] == "resnet18"
    assert TrainConfig.from_dict(nested) == config
    flat = config.flat()  # config.json as runs before the nested config wrote it
    assert TrainConfig.from_dict(flat) == config
    assert saved_settings(nested)["model"] == saved_settings(flat)["model"] == "resnet18"
    assert saved_settings({**flat, "retired_setting": 1})["retired_setting"] == 1  # read, not refused
    # a nested recipe may name a setting by its field or by its flat name
    assert TrainConfig.from_dict({"model": {"model": "lenet5"},
                                  "optimizer": {"optimizer": "sgd"}}).model.name == "lenet5"


def test_every_setting_has_one_flat_name_and_one_place():
    places = [(s.section, s.name) for s in SCHEMA.values()]
    assert len(places) == len(set(places)) == len(SCHEMA)
    assert {s.flat for s in SCHEMA.values() if s.flat != s.name} == {"data", "model", "optimizer"}
