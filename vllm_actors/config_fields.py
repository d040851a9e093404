"""Settings declared once: a dataclass field carries its default, its help text and how its
command-line flag reads (`setting`); `add_arguments` generates the argparse flags from the
fields, and `build` fills a config class from another object by field name, never by position.

vLLM's `EngineArgs` works the same way. This module imports nothing from the package.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

# field type (as written, `from __future__ import annotations`) -> the flag's value type
_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "int | None": int, "float": float,
                                            "float | None": float}


def setting(default: Any = None, help: str | None = None, *, flag: str | None = None,
            short: str | None = None, serving: bool = False, cli: bool = True,
            convert: Callable[[Any], Any] | None = None, cli_default: Any = ...,
            **argparse_kwargs: Any) -> Any:
    """A dataclass field for a setting with a command-line flag.

    flag: the flag's name (default `--field-name`); short: its short form (`-tp`);
    serving: only `serve` has it; cli: False for a setting without a flag;
    convert: turns the flag's parsed value into the field's (JSON text to a tuple);
    cli_default: the flag's default where it differs from the field's (before `convert`);
    argparse_kwargs: `choices`, `metavar`, `type`, `action` where the type does not say.
    """
    meta = {"help": help, "flag": flag, "short": short, "serving": serving, "cli": cli,
            "convert": convert, "cli_default": cli_default, "argparse": argparse_kwargs}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 metadata={"setting": meta})
    return dataclasses.field(default=default, metadata={"setting": meta})


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _argument(f: dataclasses.Field, meta: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The `add_argument` call for one field."""
    default = _default(f) if meta["cli_default"] is ... else meta["cli_default"]
    names = [meta["flag"] or "--" + f.name.replace("_", "-")]
    if meta["short"]:
        names.append(meta["short"])
    kwargs: dict[str, Any] = {"default": default, "help": meta["help"]}
    kwargs.update(meta["argparse"])
    if "action" not in kwargs and "type" not in kwargs:
        if isinstance(default, bool):
            kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif str(f.type) in _TYPES:
            kwargs["type"] = _TYPES[str(f.type)]
    if kwargs.get("action") == "store_true":
        kwargs.pop("default")
    if kwargs["help"] is None:
        kwargs.pop("help")
    return names, kwargs


def add_arguments(parser: argparse.ArgumentParser, cls: type, serving: bool = True,
                  only: Callable[[str], bool] | None = None) -> None:
    """Add a flag for each field of `cls` that has one, in field order; `serving=False`
    leaves out the server-only ones, `only` filters by field name."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("setting")
        if meta is None or not meta["cli"] or (meta["serving"] and not serving):
            continue
        if only is not None and not only(f.name):
            continue
        names, kwargs = _argument(f, meta)
        parser.add_argument(*names, dest=f.name, **kwargs)


def from_namespace(cls: type, ns: argparse.Namespace, **overrides: Any) -> Any:
    """An instance of `cls` from parsed flags: each field by name (converted where its
    setting says), missing flags at the field's default, `overrides` last."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides or not hasattr(ns, f.name):
            continue
        meta = f.metadata.get("setting") or {}
        value = getattr(ns, f.name)
        values[f.name] = meta["convert"](value) if meta.get("convert") else value
    values.update(overrides)
    return cls(**values)


def build(cls: type, source: Any, **overrides: Any) -> Any:
    """An instance of `cls` whose fields are `source`'s attributes of the same names, with
    `overrides` for fields named otherwise there (or computed). A field found in neither is
    an error: a config never silently takes a default its source meant to set."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
        elif hasattr(source, f.name):
            values[f.name] = getattr(source, f.name)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: {type(source).__name__} has no such "
                            "setting; pass it by name")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    return cls(**values)
