"""Config from YAML plus command-line overrides, with errors that name the flag.

Every leaf field of :class:`RelaxConfig` is a flag: ``train.micro_batch_size`` is ``--micro-batch-size``.
Leaf names are unique across sections, so users never type the section. YAML files may be nested by
section (``train: {lr: 1e-5}``) or flat (``lr: 1e-5``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from relax_core.config import RelaxConfig


class ConfigError(ValueError):
    """An invalid config value; the message names the flag and the rule."""


_MODE_FLAGS = {"colocate": "colocate", "fully_async": "fully_async"}


def flag_index() -> dict[str, tuple[str, str]]:
    """Map every flag name (``micro_batch_size``) to its (section, field)."""
    index: dict[str, tuple[str, str]] = {}
    for section, info in RelaxConfig.model_fields.items():
        for name in info.annotation.model_fields:  # type: ignore[union-attr]
            if name in index:
                raise AssertionError(f"duplicate config leaf {name!r}")
            index[name] = (section, name)
    return index


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_bool_field(section: str, name: str) -> bool:
    ann = RelaxConfig.model_fields[section].annotation.model_fields[name].annotation  # type: ignore[union-attr]
    return ann is bool or ann == (bool | None)


def _is_str_field(section: str, name: str) -> bool:
    ann = RelaxConfig.model_fields[section].annotation.model_fields[name].annotation  # type: ignore[union-attr]
    return ann is str or ann == (str | None)


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """Turn ``--flag value`` / ``--flag=value`` / bare boolean flags into {leaf: value}."""
    index = flag_index()
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: flags look like --name value")
        key, eq, inline = arg[2:].partition("=")
        leaf = key.replace("-", "_")
        if leaf in _MODE_FLAGS and not eq:
            out["mode"] = _MODE_FLAGS[leaf]
            i += 1
            continue
        negated = leaf.startswith("no_") and leaf[3:] in index
        if negated:
            leaf = leaf[3:]
        if leaf not in index:
            raise ConfigError(f"unknown flag --{key}; see `relax train --help` for the list")
        section, name = index[leaf]
        if _is_bool_field(section, name) and not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.lower() in ("true", "false"):
                out[leaf] = nxt.lower() == "true"
                i += 2
            else:
                out[leaf] = not negated
                i += 1
            continue
        if eq:
            raw = inline
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"{_flag(leaf)} needs a value")
            raw = argv[i + 1]
            i += 2
        # a text flag keeps its text even when it looks like a number (--output-dir 2024); "none" means
        # None only where None is allowed (--rm-type none names the no-reward reward)
        ann = RelaxConfig.model_fields[section].annotation.model_fields[name].annotation  # type: ignore[union-attr]
        keep_text = _is_str_field(section, name) and (ann is str or raw.lower() not in ("none", "null"))
        out[leaf] = raw if keep_text else _scalar(raw)
    return out


def _scalar(raw: str) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    return value if isinstance(value, (int, float, bool, list, dict)) else raw


def _flatten_yaml(data: dict[str, Any], source: str) -> dict[str, Any]:
    index = flag_index()
    flat: dict[str, Any] = {}
    for key, value in data.items():
        k = key.replace("-", "_")
        if k in RelaxConfig.model_fields and isinstance(value, dict):
            for sub, v in value.items():
                flat[sub.replace("-", "_")] = v
        elif k in _MODE_FLAGS and value is True:
            flat["mode"] = _MODE_FLAGS[k]
        else:
            flat[k] = value
    for k in flat:
        if k not in index:
            raise ConfigError(f"{source}: unknown key {k!r}")
    return flat


def build_config(
    yaml_path: str | Path | None = None, argv: list[str] | None = None, defaults: dict[str, Any] | None = None
) -> RelaxConfig:
    """defaults < YAML file (optional) < command-line overrides → validated config.

    Raises ConfigError naming the flag and the rule."""
    flat: dict[str, Any] = dict(defaults or {})
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:  # (its message carries the line and column)
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 (byte {e.start}); re-encode the config file as UTF-8") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of flag names to values")
        flat.update(_flatten_yaml(data, str(path)))
    flat.update(parse_overrides(list(argv or [])))
    return config_from_flat(flat)


def config_from_flat(flat: dict[str, Any]) -> RelaxConfig:
    index = flag_index()
    nested: dict[str, dict[str, Any]] = {}
    for leaf, value in flat.items():
        if leaf not in index:
            raise ConfigError(f"unknown flag {_flag(leaf)}")
        section, name = index[leaf]
        nested.setdefault(section, {})[name] = value
    try:
        return RelaxConfig.model_validate(nested)
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None


def _explain(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        leaf = loc[-1] if len(loc) >= 2 else None
        got = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if leaf and leaf in flag_index():
            lines.append(f"{_flag(leaf)}: {msg} (got {got!r})")
        else:
            lines.append(msg)
    return "invalid config: " + "; ".join(lines)


def help_text() -> str:
    """One line per flag with its default and docstring, grouped by section."""
    rows = []
    for section, info in RelaxConfig.model_fields.items():
        rows.append(f"\n{section}:")
        for name, f in info.annotation.model_fields.items():  # type: ignore[union-attr]
            doc = (f.description or "").replace("\n", " ")
            rows.append(f"  {_flag(name):32s} (default {f.default!r}) {doc}")
    rows.append("\n  --colocate / --fully-async          shorthand for --mode colocate / --mode fully_async")
    return "\n".join(rows)
