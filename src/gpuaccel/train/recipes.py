"""Recipes: named, plain-data training settings (YAML files) that a user can copy and edit.

``--recipe NAME`` reads ``gpuaccel/recipes/NAME.yaml`` shipped with the package;
``--recipe PATH.yaml`` reads the user's own. Command-line options override it. A recipe
is flat (``lr: 0.1``) or nested by the config's sections (``optimizer: {lr: 0.1}``), which
is how ``gpuaccel train --print-config`` writes one.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from ..errors import GpuaccelError, choice_error
from .config import flatten_sections


def list_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("gpuaccel.recipes").iterdir() if p.name.endswith(".yaml"))


def load_recipe(name_or_path: str) -> dict:
    """The recipe's settings as flat keys (a recipe may also nest them by section); unknown
    keys are errors."""
    import yaml

    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise GpuaccelError(f"recipe file {path} does not exist")
        text = path.read_text()
    else:
        if name_or_path not in list_recipes():
            raise choice_error("recipe", name_or_path, list_recipes() + ["PATH.yaml"])
        text = resources.files("gpuaccel.recipes").joinpath(f"{name_or_path}.yaml").read_text()
    try:
        values = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise GpuaccelError(f"recipe {name_or_path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(values, dict):
        raise GpuaccelError(f"recipe {name_or_path} must be a mapping of setting: value")
    return flatten_sections(values)


DEMO_RECIPE = "digits"  # what `gpuaccel train` alone trains: the built-in data set with its own recipe


def training_settings(options: dict, recipe: str | None = None, resume: str | None = None) -> dict:
    """The settings a train command runs with: ``options`` (what the user set) over ``recipe``'s.
    With no recipe, no run to resume and no training setting given (logging settings aside), it is
    the demo (:data:`DEMO_RECIPE`); any training setting means the user chose, and the plain
    defaults apply beneath it, with no recipe."""
    from .config import SCHEMA

    if resume and recipe:
        raise GpuaccelError("--resume continues a run with its own settings; drop --recipe")
    if not resume and not recipe and all(k in SCHEMA and SCHEMA[k].section == "logging" for k in options):
        recipe = DEMO_RECIPE
    return over_recipe(load_recipe(recipe), options) if recipe else dict(options)


def over_recipe(recipe: dict, options: dict) -> dict:
    """``options`` over a recipe's settings. Model arguments change the recipe's key by key
    (``--recipe gpt2-small --model-args activation=gelu`` keeps its 12 layers); with another model
    than the recipe's, the recipe's model arguments, which were for its model, are left out."""
    settings = {**recipe, **options}
    if recipe.get("model_args") is not None:
        if settings.get("model") != recipe.get("model"):
            settings["model_args"] = options.get("model_args")
        elif isinstance(options.get("model_args"), dict):
            settings["model_args"] = {**recipe["model_args"], **options["model_args"]}
    return settings


def compile_where_it_pays(settings: dict, options: dict, recipe: str | None, gpu: bool) -> str | None:
    """A shipped recipe compiles for GPUs, where a run is long enough to repay it. On a CPU,
    compiling takes a minute or more before the first step (an hour-long run would repay it, a
    recipe's short one does not): there a recipe runs uncompiled unless the command line asks for
    ``--compile`` itself. Changes ``settings``; returns the note to print, or None."""
    if recipe and not gpu and settings.get("compile") and "compile" not in options:
        settings["compile"] = False
        return (f"the {recipe} recipe compiles its model for GPUs; on this CPU it runs uncompiled (compiling "
                f"would take a minute or more before the first step; --compile compiles anyway)")
    return None
