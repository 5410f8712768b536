"""One config schema: each setting declared once; the CLI, recipes and bench options made from it."""

from __future__ import annotations

import dataclasses
import io
from contextlib import redirect_stdout

import pytest
import yaml

from gpuaccel import GpuaccelError, TrainConfig
from gpuaccel.cli import build_parser, main
from gpuaccel.train.config import SECTIONS, flatten_sections


def _help(*command: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--help"])
    return " ".join(out.getvalue().split())


def test_every_setting_is_an_option_with_help_in_its_section():
    text = _help("train")
    for f in dataclasses.fields(TrainConfig):
        assert f.metadata["section"] in SECTIONS and f.metadata["help"], f.name
        if f.metadata["cli"]:
            assert "--" + f.name.replace("_", "-") in text, f.name
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
    assert expected.model == "fastnet" and expected.lr == 1.5


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
    declared = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainConfig)}
    assert " ".join(declared["crop_padding"].split()) in text and "(default 4)" in text  # bench's default
    assert "--time-to-acc" in text and "--quick" in text


def test_a_value_outside_its_choices_names_them():
    with pytest.raises(GpuaccelError, match=r"unknown optimizer 'adam'; did you mean 'adamw'\? choose one of: sgd, adamw, muon"):
        TrainConfig(optimizer="adam").validate()
