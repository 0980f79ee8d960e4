"""Settings objects declare each knob once: its default, its help and its command-line flag.

A settings dataclass (``TrainConfig``, ``ServeConfig``) gives each field a :func:`setting`; the
CLI builds its options from the fields with :func:`add_options` and the object back from the
parsed arguments with :func:`from_args`, so a default or a help text is never written twice, and
the object's own ``validate()`` is the only check (objects that are frozen once made, such as
``ServeConfig``, call it from ``__post_init__``; ``DecodingParams.validate`` returns the copy with
its defaults resolved against the checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from typing import Any

from .errors import UserError

# Weights dtypes a command may load a model in (modeling.load_model; auto: as saved).
DTYPE_NAMES = ("auto", "float32", "float64", "bfloat16", "float16")


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    choices=None,
    metavar: str | None = None,
    parse=None,
    negative: str | None = None,
    repeat: bool = False,
    nargs: str | None = None,
    cli: bool = True,
):
    """A dataclass field with what its command-line option needs.

    ``flag`` overrides the option name (``--field-name``); ``aliases`` adds more; ``parse`` turns
    the option's text into the field's value; ``negative`` names the flag that turns a boolean
    that defaults to True off (``--no-resume``); ``repeat`` collects a repeated option into a
    tuple, ``nargs="+"`` one option's several values; ``cli=False`` keeps a field off the command
    line.
    """
    metadata = dict(
        help=help,
        flag=flag,
        aliases=aliases,
        choices=choices,
        metavar=metavar,
        parse=parse,
        negative=negative,
        repeat=repeat,
        nargs=nargs,
        cli=cli,
    )
    if isinstance(default, (dict, list)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(cls, name: str) -> str:
    """The command-line flag of a field (for error messages that name what the user typed)."""
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}.get(name, {})
    return meta.get("flag") or "--" + name.replace("_", "-")


def add_options(
    parser: argparse.ArgumentParser,
    cls,
    *,
    positional: tuple[str, ...] = (),
    skip: tuple[str, ...] = (),
    defaults: dict | None = None,
) -> None:
    """One option per field of ``cls`` (``positional`` fields become positional arguments).

    ``defaults`` replaces a field's default on this command line only (``marslm generate`` shows
    MARS at tau 0.95, where the library's default is plain AR decoding).
    """
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if f.name in skip or not meta.get("cli", True):
            continue
        kind = hints[f.name]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if required else (f.default if f.default is not dataclasses.MISSING else f.default_factory())
        if defaults and f.name in defaults:
            default = defaults[f.name]
        help_text = meta.get("help", "")
        if not required and default not in (None, False, True, "", ()):
            help_text += f" (default {default})"
        common = dict(dest=f.name, help=help_text)
        if f.name in positional:
            parser.add_argument(
                f.name,
                choices=meta.get("choices"),
                nargs=meta.get("nargs"),
                metavar=meta.get("metavar"),
                help=help_text,
            )
            continue
        names = [meta.get("flag") or "--" + f.name.replace("_", "-"), *meta.get("aliases", ())]
        if meta.get("repeat"):
            parser.add_argument(*names, action="append", default=[], metavar=meta.get("metavar"), **common)
            continue
        if kind is bool:
            if default:
                parser.add_argument(
                    meta.get("negative") or "--no-" + f.name.replace("_", "-"), action="store_false", **common
                )
            else:
                parser.add_argument(*names, action="store_true", **common)
            continue
        parser.add_argument(
            *names,
            type=meta.get("parse") or _scalar(kind),
            default=default,
            required=required,
            choices=meta.get("choices"),
            metavar=meta.get("metavar"),
            nargs=meta.get("nargs"),
            **common,
        )


def from_args(cls, args: argparse.Namespace, **overrides):
    """An instance of ``cls`` from parsed arguments (fields the parser lacks keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    for f in dataclasses.fields(cls):
        if (f.metadata.get("repeat") or f.metadata.get("nargs")) and f.name in values:
            values[f.name] = tuple(values[f.name])
    return cls(**{**values, **overrides})


def _scalar(kind):
    """The argparse type of an annotation such as ``int | None``."""
    options = [k for k in typing.get_args(kind) if k is not type(None)] or [kind]
    return options[0] if options[0] in (int, float, str) else str


# List-valued option types (a setting's parse, or an argparse type): comma-separated values.
def floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def strings(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def int_or_auto(text: str) -> int | str | None:
    """An integer, the word auto (a setting the program measures for itself) or off (None)."""
    if text == "auto":
        return text
    if text == "off":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, auto or off, got {text!r}") from None


# The most items a count may ask for (prompts, requests, batch rows, widths): past it a count is a
# slip of the keyboard, and building that many would exhaust memory before the run began.
MAX_COUNT = 1_000_000


def check_count(flag: str, value: int, high: int = MAX_COUNT) -> None:
    """An integer in 1..``high``, or one line naming ``flag``."""
    if not 1 <= value <= high:
        raise UserError(f"{flag} must be in 1..{high}, got {value}")


def check_range(
    flag: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A finite number within [low, high] (an open end excludes the bound), or one line naming ``flag``."""
    if not math.isfinite(value):
        raise UserError(f"{flag} must be a finite number, got {value}")
    if low is not None and (value < low or (low_open and value == low)):
        raise UserError(f"{flag} must be {'>' if low_open else '>='} {low:g}, got {value:g}")
    if high is not None and (value > high or (high_open and value == high)):
        raise UserError(f"{flag} must be {'<' if high_open else '<='} {high:g}, got {value:g}")
