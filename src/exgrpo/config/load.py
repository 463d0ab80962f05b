"""Building a config from dicts, YAML files and dotted command-line overrides; errors name the field."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from exgrpo.config.presets import config_file
from exgrpo.config.renamed import rename_fields, rename_overrides
from exgrpo.config.rules import changed_fields, validate
from exgrpo.config.schema import ExGRPOConfig
from exgrpo.errors import ConfigError


def _resolve(tp: Any) -> tuple[Any, bool]:
    """(inner type, optional?) of a field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else tp), len(args) < len(typing.get_args(tp))
    return tp, False


_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[value.lower()]
    raise ValueError


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError
    return int(float(value)) if isinstance(value, str) and "e" in value.lower() else int(value)  # "1e3" from a CLI


def _as_float(value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError
    return float(value)


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError
    return value


# a scalar field's type: what the error says was expected, and the conversion (which raises TypeError or ValueError)
_SCALARS = {bool: ("true or false", _as_bool), int: ("an integer", _as_int), float: ("a number", _as_float),
            str: ("a string", _as_str)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    inner, optional = _resolve(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: null is not allowed (expected {_describe(inner)})")
    if dataclasses.is_dataclass(inner):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of {sorted(f.name for f in dataclasses.fields(inner))}")
        return _build(inner, value, where)
    if typing.get_origin(inner) is Literal:
        allowed = typing.get_args(inner)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; expected one of {list(allowed)}")
        return value
    if inner in _SCALARS:
        expected, convert = _SCALARS[inner]
        try:
            return convert(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected {expected}, got {value!r}") from None
    raise ConfigError(f"{where}: unsupported type {tp}")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return f"one of {list(typing.get_args(tp))}"
    return getattr(tp, "__name__", str(tp))


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        where = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        of = f" of {prefix}" if prefix else ""
        raise ConfigError(f"unknown config field '{where}'; allowed fields{of}: {sorted(names)}")
    kwargs = {name: _coerce(v, hints[name], f"{prefix}.{name}" if prefix else name) for name, v in values.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - all fields have defaults
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{key}' is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """Accept `key.sub=value`, `--key.sub=value` and `--key.sub value`; values are parsed as YAML scalars."""
    pairs, i = [], 0
    while i < len(args):
        arg = args[i]
        key = arg[2:] if arg.startswith("--") else arg
        if "=" in key:
            key, raw = key.split("=", 1)
        elif arg.startswith("--") and i + 1 < len(args):
            i += 1
            raw = args[i]
        else:
            raise ConfigError(f"override {arg!r} must look like section.field=value or --section.field value")
        pairs.append((key, _override_value(key, raw)))
        i += 1
    return pairs


def _override_value(key: str, raw: str) -> Any:
    """An override's value parsed as YAML ("" stays ""); text that is not YAML is an error naming the override."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"override {key}={raw}: {raw!r} is not a YAML value ({getattr(e, 'problem', e)}{at}); "
                          f"to give it as text, quote it: '{key}=\"{raw}\"'") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error (YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # a list or mapping as a key: PyYAML's own check below says "found unhashable key"
                continue
            if key in seen:
                raise ConfigError(f"{self.name}: key {key!r} appears twice in one mapping (lines {seen[key] + 1} and "
                                  f"{key_node.start_mark.line + 1}); remove one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path, what: str):
    """The parsed YAML of `path`; a missing file, invalid YAML, a key given twice or bytes that are not UTF-8 are a
    ConfigError naming the file (and the line)."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; expected a YAML file")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")
    try:
        loader = _UniqueKeyLoader(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path} line {line}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    loader.name = str(path)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    finally:
        loader.dispose()


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error on one line: what is wrong and where ("found unexpected end of stream (line 4, column 16)")."""
    mark = getattr(error, "problem_mark", None)
    problem = " ".join(str(getattr(error, "problem", None) or error).split())
    return problem + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else "")


def read_run_config(path: Path) -> dict:
    """The resolved config a run stored (its config.json): a mapping of sections; anything else (an empty file,
    null, a list, a string) is a ConfigError naming the file, never read as "every field at its default"."""
    stored = read_yaml(path, "run config")
    if not isinstance(stored, dict) or not stored or not all(isinstance(v, dict) for v in stored.values()):
        got = "nothing (an empty file or null)" if stored is None or stored == {} else _kind(stored)
        raise ConfigError(f"{path}: expected the run's resolved config, a mapping of sections (model, data, train, "
                          f"...), got {got}; the file is damaged: restore it, or give the run's config with --config")
    return stored


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        bad = next(k for k, v in value.items() if not isinstance(v, dict))
        return f"{bad!r} set to {_kind(value[bad])} instead of a section"
    kind = {list: "a list", str: "a string", bool: "true or false", int: "a number", float: "a number"}
    return f"{kind.get(type(value), type(value).__name__)} ({json.dumps(value)[:40]})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> ExGRPOConfig:
    """Defaults, then `base` (e.g. a checkpoint's resolved config) or the YAML file (a path or a preset's name),
    then dotted overrides. Rules about fields that apply only with others are judged on the fields the file and the
    overrides set."""
    tree: dict = rename_fields(copy.deepcopy(base or {}))
    if path is not None:
        path = config_file(path)
        loaded = read_yaml(path, "config file")
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
        tree = rename_fields(loaded or {})
        try:  # the file's own fields and types first, so that an override's mistake is not blamed on the file
            _build(ExGRPOConfig, copy.deepcopy(tree))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
    given = _dotted_keys(tree) if path is not None else set()  # a resolved `base` sets every field
    for key, value in rename_overrides(parse_overrides(overrides or [])):
        _set_dotted(tree, key, value)
        given.add(key)
    try:
        return _build_validated(tree, given)
    except ConfigError as e:
        where = f"{path} with the overrides" if path and overrides else path
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def config_from_dict(values: dict) -> ExGRPOConfig:
    """A config from nested sections, e.g. {"train": {"steps": 4}}; the fields present count as set."""
    values = rename_fields(copy.deepcopy(values))
    return _build_validated(values, _dotted_keys(values))


def _build_validated(tree: dict, given: set[str]) -> ExGRPOConfig:
    config = _build(ExGRPOConfig, tree)
    validate(config, given | changed_fields(config))
    return config


def _dotted_keys(tree: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        out |= _dotted_keys(value, dotted + ".") if isinstance(value, dict) else {dotted}
    return out
