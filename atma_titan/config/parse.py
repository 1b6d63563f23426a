"""Reading a config: defaults < the TOML file < `--section.key value` flags, each value coerced to its
field's type and checked against its allowed values.

A bad file, section, key, type or value raises `ConfigError` with a message naming where it came from,
what was given and what is allowed; `train.py` turns that into a non-zero exit without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any

from atma_titan.config.sections import SECTION_TYPES, JobConfig, field_types, type_name
from atma_titan.config.validation import validate
from atma_titan.utils.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


def _coerce(value: Any, tp: Any, from_cli: bool) -> Any:
    """Convert `value` to the field type `tp`; raise TypeError with a short reason."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), from_cli)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise TypeError("expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise TypeError("expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError("expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if from_cli:
            return str(value)
        raise TypeError("expected a string")
    if origin is list and args == (dict,):  # a list of tables: [[data.sources]]
        if isinstance(value, list) and not from_cli:
            return value
        raise TypeError("a list of tables: write it in the TOML file as [[section.key]] tables")
    if tp is list or origin is list:
        if isinstance(value, list):
            return value
        if from_cli and isinstance(value, str):  # "[1, 2]" or "1,2"; pairs "[[3, 4], [6, 6]]" flatten (data.skip)
            flat = value.replace("[", "").replace("]", "")
            return [float(v) if "." in v or "e" in v.lower() else int(v) for v in flat.split(",") if v.strip()]
        raise TypeError("expected a list")
    raise TypeError(f"unsupported field type {tp}")


def _set_field(cfg: JobConfig, section: str, key: str, value: Any, origin: str, from_cli: bool) -> None:
    all_sections = SECTION_TYPES
    if section not in all_sections:
        raise ConfigError(
            f"{origin}: unknown section [{section}]; allowed: {', '.join(all_sections)}."
            f"{_closest(section, all_sections)}"
        )
    section_obj = getattr(cfg, section)
    fields = _fields(type(section_obj))
    if key not in fields:
        raise ConfigError(
            f"{origin}: unknown key '{section}.{key}'; allowed in [{section}]: {', '.join(fields)}."
            f"{_closest(key, fields)}"
        )
    tp = field_types(type(section_obj))[key]
    try:
        coerced = _coerce(value, tp, from_cli)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{origin}: '{section}.{key}' = {value!r} is invalid: {e} ({type_name(tp)}).") from None
    choices = fields[key].metadata.get("choices")
    if choices and coerced is not None and coerced not in choices:
        raise ConfigError(
            f"{origin}: '{section}.{key}' = {coerced!r} is not allowed; choose one of: {', '.join(map(str, choices))}."
            f"{_closest(str(coerced), choices)}"
        )
    setattr(section_obj, key, coerced)


def load_toml(cfg: JobConfig, path: str | Path) -> None:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(
                f"{path}: top-level key '{section}' must be a [section] table; allowed sections: "
                f"{', '.join(SECTION_TYPES)}.{_closest(section, SECTION_TYPES)}"
            )
        for key, value in table.items():
            _set_field(cfg, section, key, value, str(path), from_cli=False)


def parse_overrides(argv: list[str]) -> list[tuple[str, str, str]]:
    """`--section.key value` / `--section.key=value` pairs -> (section, key, raw value)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"command line: expected --section.key value, got {arg!r} (see --help).")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: {arg} needs a value.")
            value, i = argv[i + 1], i + 1
        section, _, key = name.partition(".")
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
        i += 1
    return out


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Build the resolved config from `--config FILE` and `--section.key value` flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("command line: --config needs a TOML file path.")
        config_path = argv[i + 1]
        del argv[i : i + 2]
    else:
        for i, a in enumerate(argv):
            if a.startswith("--config="):
                config_path = a.split("=", 1)[1]
                del argv[i]
                break
    cfg = JobConfig()
    if config_path:
        load_toml(cfg, config_path)
    for section, key, value in parse_overrides(argv):
        _set_field(cfg, section, key, value, f"command line --{section}.{key}", from_cli=True)
    validate(cfg, origin=config_path or "command line")
    return cfg
