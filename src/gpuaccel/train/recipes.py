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
