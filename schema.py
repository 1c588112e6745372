"""Typed configuration: dataclasses are the schema, YAML and ``a.b=c`` overrides fill them.

Rules every config class follows (torchtune/litgpt style):

* a config section is a ``@dataclass`` whose fields carry a docstring right below them;
* unknown keys are errors that name the key and list the valid ones;
* ``Literal[...]`` fields list their valid choices in the error;
* a field typed as a union of dataclasses is *tagged*: each member has a
  ``type: Literal["name"]`` field and the YAML's ``type:`` key picks the member;
* a union defined *above* the class that holds it (a drafter family whose own fields are drafter
  sections, while the registry that builds the union of all families lists that family) is named:
  the field is ``Section["name"]`` and the module that builds the union calls :func:`define_section`;
* components (modules, losses, the decoder) receive plain values, never a config object.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Protocol, TypeVar, Union, get_args, get_origin

import yaml

from .errors import ConfigError
from .files import write_text

T = TypeVar("T")
_SECTIONS: dict[str, Any] = {}


class Section:
    """A section type named where it is used and defined by the module that builds it.

    ``field: Section["model_drafter"]`` is ``Annotated[Any, Section("model_drafter")]``: type checkers
    see ``Any``; :func:`from_dict` parses the value as the type :func:`define_section` gave the name.
    For a type that lies above the class holding it, so that the holder's file need not import the
    builder's (no import circle, no module global patched from outside).
    """

    def __init__(self, name: str):
        self.name = name

    def __class_getitem__(cls, name: str) -> Any:
        return Annotated[Any, cls(name)]

    def __repr__(self) -> str:
        return f"Section[{self.name!r}]"


def define_section(name: str, tp: Any) -> None:
    """Give the named section type ``name`` its type (a tagged union of config dataclasses)."""
    _SECTIONS[name] = tp


def section(name: str) -> Any:
    """The type defined for the named section ``name`` (TypeError when no module defined it)."""
    if name not in _SECTIONS:
        raise TypeError(f"section type {name!r} is not defined; import the module that defines it "
                        f"(the drafter sections: draftsmith.drafters)")
    return _SECTIONS[name]


def choices(tp: Any) -> dict[str, type]:
    """The members of a tagged union (or of a named section) by their ``type`` tag."""
    if isinstance(tp, str):
        tp = section(tp)
    tags = {}
    for m in get_args(tp) or (tp,):
        tag_tp = typing.get_type_hints(m).get("type")
        if get_origin(tag_tp) is not Literal:
            raise TypeError(f"{m.__name__} in a tagged union needs a `type: Literal[...]` field")
        for tag in get_args(tag_tp):
            tags[tag] = m
    return tags


def from_dict(cls: type[T], data: Mapping[str, Any] | None, where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``, validating every key and value."""
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"'{where or cls.__name__}' must be a mapping of keys to values, got {type(data).__name__}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = _join(where, unknown[0])
        raise ConfigError(f"unknown config key '{key}'; valid keys here: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, _join(where, name))
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"config key '{_join(where, missing[0])}' is required")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if callable(check):
        check()
    return obj


def to_dict(obj: Any) -> Any:
    """Plain YAML-able structure of a config (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["decode.k=5", "target.dtype=bfloat16"]`` → nested dict; values are parsed as YAML."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            reason = getattr(e, "problem", None) or type(e).__name__
            raise ConfigError(f"override '{item}': the value is not valid YAML ({reason}); "
                              "quote a string, close a list with ]") from e
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}' conflicts with another override of '{part}'")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Recursive merge; ``over`` wins. A new ``type`` for a tagged section drops the old keys."""
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            old = out[k]
            if "type" in v and v["type"] != old.get("type"):
                old = {}
            out[k] = merge(dict(old), v)
        else:
            out[k] = v
    return out


def load_yaml(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        raise ConfigError(f"config file '{path}' is a folder; give a recipe YAML file or a name from `draftsmith configs`")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"config file '{path}' does not exist") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r}); "
                          "save it as UTF-8") from e
    except OSError as e:
        raise ConfigError(f"config file '{path}' cannot be read: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from e
    if data is None:
        raise ConfigError(f"config file '{path}' is empty; a recipe names at least its target (see `draftsmith configs`)")
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping at the top level")
    return data


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False)


class SavedRecipe(Protocol):
    """What :func:`save_recipe` reads of a recipe: its run folder (and its fields, through :func:`to_dict`). Every
    stage's recipe Protocol (``PrepareRecipe``, ``EvalRecipe``, ``TrainRecipe``, ``ReportRecipe``) and the top-level
    ``config.Recipe`` satisfy it; it is written here because every stage that saves a recipe lies above."""

    run_dir: str


def save_recipe(recipe: SavedRecipe, run_dir: str | None = None) -> str:
    """Write a resolved recipe (a config dataclass with a ``run_dir``) to ``<run_dir>/config.yaml``
    atomically; return its path. Here, below every stage that writes one, not in ``config.py``,
    which imports the stages' sections."""
    path = os.path.join(run_dir or recipe.run_dir, "config.yaml")
    write_text(path, dump_yaml(recipe))
    return path


# ---------------------------------------------------------------- internals


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extras = get_args(tp)
        named = [e for e in extras if isinstance(e, Section)]
        return _coerce(section(named[0].name) if named else base, value, where)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        members = get_args(tp)
        if value is None and type(None) in members:
            return None
        members = tuple(m for m in members if m is not type(None))
        if all(dataclasses.is_dataclass(m) for m in members):
            return _coerce_tagged(members, value, where)
        errors = []
        for m in members:
            try:
                return _coerce(m, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"'{where}': {value!r} fits none of the allowed types")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"'{where}' = {value!r} is not valid; choose one of: {', '.join(map(str, choices))}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{where}' must be a list, got {value!r}")
        args = get_args(tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(f"'{where}' must have {len(args)} items, got {len(value)}")
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [_coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{where}' must be a mapping, got {value!r}")
        _, vt = get_args(tp) or (str, Any)
        return {str(k): _coerce(vt, v, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"'{where}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{where}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            value = _yaml11_float(value)  # PyYAML reads 1e-4 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{where}' must be a number, got {value!r}")
        if not math.isfinite(value):  # no setting means anything at nan or inf, and nan passes every `<` check
            raise ConfigError(f"'{where}' must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"'{where}' must be a string, got {value!r}")
        return str(value)
    raise TypeError(f"config field '{where}' has an unsupported type {_type_name(tp)}")


def _yaml11_float(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _coerce_tagged(members: tuple[type, ...], value: Any, where: str) -> Any:
    tags = choices(Union[members])
    if not isinstance(value, Mapping) or "type" not in value:
        raise ConfigError(f"'{where}' needs a 'type' key; choose one of: {', '.join(tags)}")
    tag = value["type"]
    if tag not in tags:
        raise ConfigError(f"'{where}.type' = {tag!r} is not valid; choose one of: {', '.join(tags)}")
    return from_dict(tags[tag], value, where)
