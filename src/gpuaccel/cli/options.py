"""Command-line options made from the training schema (train/config.py): each TrainConfig setting
becomes an option of its section's group, with its type, help, valid values and default declared
there once; and the parser every command uses (a bad option is one line, exit status 2)."""

from __future__ import annotations

import argparse

from ..errors import GpuaccelError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad option is one line (plus where to find help), exit status 2, and an
    option is spelled out in full (``--epoch 1`` is not taken for ``--epochs 1``)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise GpuaccelError(f"{message} (see '{self.prog} --help')")


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def keywords(text: str) -> dict:
    """'layers=6,width=384,activation=gelu' -> {'layers': 6, 'width': 384, 'activation': 'gelu'}
    (values read as YAML scalars: numbers, booleans, null, else strings)."""
    import yaml

    result = {}
    for item in comma_list(text):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        try:
            result[key.strip()] = yaml.safe_load(value.strip())
        except yaml.YAMLError:
            result[key.strip()] = value.strip()
    return result


def add_config_options(parser, names=None, shown_defaults: dict | None = None) -> None:
    """TrainConfig's settings (all, or those in ``names``: flat names) as options, one group per
    section (the data section's by the kinds whose option group a setting is in), made from the
    schema (train/config.py): type, help, valid values and default declared there once. Every
    option defaults to None here, so that what the user typed is known."""
    import typing

    from ..data.kinds import data_kinds, setting_kinds
    from ..train.config import SCHEMA

    kinds = [kind.name for kind in data_kinds()]
    owners = setting_kinds()  # a data setting -> the kinds it is for

    def group_of(setting) -> tuple[str, tuple[str, ...]]:
        """(its section, the kinds it is for: none where every kind's)."""
        return setting.section, owners.get(setting.flat, ())

    def title(section: str, kinds_of: tuple[str, ...]) -> str:
        if not kinds_of:
            return f"{section} settings"
        named = " and ".join([", ".join(kinds_of[:-1]), kinds_of[-1]] if len(kinds_of) > 1 else kinds_of)
        return f"{section} settings ({named} data)"

    sections = list(dict.fromkeys(s.section for s in SCHEMA.values()))
    keys = sorted({group_of(s) for s in SCHEMA.values()},  # each section's groups together, kind by kind
                  key=lambda key: (sections.index(key[0]), [kinds.index(k) for k in key[1]]))
    groups = {key: parser.add_argument_group(title(*key)) for key in keys}
    for s in SCHEMA.values():
        meta = s.field.metadata
        if not meta["cli"] or (names is not None and s.flat not in names):
            continue
        group = groups[group_of(s)]
        default = (shown_defaults or {}).get(s.flat, s.default)
        text = meta["help"]
        if meta["choices"] and not all(c in text for c in meta["choices"]):
            text += f"; one of: {', '.join(meta['choices'])}"
        if default not in (None, False, "default") and "default" not in text:
            text += f" (default {default:g})" if isinstance(default, float) else f" (default {default})"
        options = dict(help=text.replace("%", "%%"), default=None)
        if s.type is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            parse = {list: comma_list, dict: keywords}.get(typing.get_origin(s.type) or s.type, s.type)
            options.update(type=parse, metavar=meta["metavar"] or s.flat.upper())
        group.add_argument("--" + s.flat.replace("_", "-"), **options)


def explicit_options(args: argparse.Namespace) -> dict:
    """The TrainConfig settings (flat names) the user set on the command line (every option
    defaults to None)."""
    from ..train.config import SCHEMA

    return {k: v for k, v in vars(args).items() if k in SCHEMA and v is not None}
