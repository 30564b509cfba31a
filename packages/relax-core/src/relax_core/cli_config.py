"""Config from YAML plus command-line overrides, with errors that name the flag.

Every leaf field of :class:`RelaxConfig` is a flag: ``train.micro_batch_size`` is ``--micro-batch-size``.
Leaf names are unique across sections, so users never type the section. YAML files may be nested by
section (``train: {lr: 1e-5}``) or flat (``lr: 1e-5``). slime's names for the same knobs are accepted too
(:mod:`relax_core.cli_aliases`), and an unknown flag names the closest known one.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from relax_core import cli_aliases as aliases
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
    return _parse(argv)[0]


def _parse(argv: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """{leaf: value}, and {leaf: the name it was given under} (ours, or a slime alias: cli_aliases)."""
    index = flag_index()
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
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
        if leaf in aliases.MULTI_VALUE:
            if eq:
                values, i = [inline], i + 1
            else:
                j = i + 1
                while j < len(argv) and not argv[j].startswith("--"):
                    j += 1
                if j == i + 1:
                    raise ConfigError(f"--{key} needs a value")
                values, i = argv[i + 1 : j], j
            try:
                value = aliases.multi_value(leaf, values)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            _put(out, given, aliases.ALIASES.get(leaf, leaf), leaf, value)
            continue
        switch = leaf[3:] if leaf.startswith("no_") else leaf
        if switch in aliases.SWITCHES or switch in aliases.ENABLES:
            on = switch == leaf
            if eq or (i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false")):
                raw = inline if eq else argv[i + 1]
                if raw.lower() not in ("true", "false"):
                    raise ConfigError(
                        f"--{key} is an on/off flag: give it bare, or true / false (got {raw!r})"
                    )
                on = on == (raw.lower() == "true")
                i += 0 if eq else 1
            i += 1
            _switch(out, given, switch, on)
            continue
        named = leaf
        negated = leaf.startswith("no_") and leaf[3:] in index
        if negated:
            leaf = named = leaf[3:]
        leaf = aliases.ALIASES.get(leaf, leaf)
        if named in aliases.NO_EQUIVALENT:
            leaf = named
        elif leaf not in index:
            message = _unknown(f"unknown flag --{key}", key)
            raise ConfigError(f"{message}; see `relax train --help` for the list")
        if leaf in index and _is_bool_field(*index[leaf]) and not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.lower() in ("true", "false"):
                _put(out, given, leaf, named, nxt.lower() == "true")
                i += 2
            else:
                _put(out, given, leaf, named, not negated)
                i += 1
            continue
        if eq:
            raw = inline
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"--{key} needs a value")
            raw = argv[i + 1]
            i += 2
        if named in aliases.NO_EQUIVALENT:
            _refuse(named, _scalar(raw))
            continue
        # a text flag keeps its text even when it looks like a number (--output-dir 2024); "none" means
        # None only where None is allowed (--rm-type none names the no-reward reward)
        section, name = index[leaf]
        ann = RelaxConfig.model_fields[section].annotation.model_fields[name].annotation  # type: ignore[union-attr]
        keep_text = _is_str_field(section, name) and (ann is str or raw.lower() not in ("none", "null"))
        _put(out, given, leaf, named, aliases.translate(named, raw if keep_text else _scalar(raw)))
    return out, given


def _switch(out: dict[str, Any], given: dict[str, str], name: str, on: bool) -> None:
    """slime's on/off flag ``name`` (cli_aliases.SWITCHES / ENABLES) given as ``on``; off sets nothing. An
    ENABLES switch is kept in ``given`` under its own name, checked once every source is read."""
    if not on:
        return
    if name in aliases.SWITCHES:
        field, value = aliases.SWITCHES[name]
        _put(out, given, field, name, value)
    else:
        given[name] = name


def _put(out: dict[str, Any], given: dict[str, str], leaf: str, named: str, value: Any) -> None:
    """Set ``leaf``; set before under another name (ours and an alias): the two must agree (cli_aliases)."""
    if leaf in given and given[leaf] != named:
        try:
            merged = aliases.merge(leaf, (given[leaf], out[leaf]), (named, value))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if merged == out[leaf]:  # (the name the value came under stays: start_notes reads it)
            return
        value = merged
    out[leaf] = value
    given[leaf] = named


def _refuse(name: str, value: Any) -> None:
    """A slime name with no equivalent here: a value asking for what relax does anyway passes."""
    if value not in aliases.NEUTRAL.get(name, ()):
        raise ConfigError(f"{_flag(name)} {value!r}: no equivalent in relax; {aliases.NO_EQUIVALENT[name]}")


def _known_names() -> list[str]:
    index = flag_index()
    bools = [f"no_{leaf}" for leaf, where in index.items() if _is_bool_field(*where)]
    return [*index, *bools, *aliases.table_names(), *_MODE_FLAGS]


def _unknown(message: str, key: str) -> str:
    """``message``, with the closest known flag when one is close: "did you mean --lr?". A name close to one
    of slime's / veRL's (cli_aliases' tables) is hinted that name first: a slime user's typo is of a slime
    name, and the nearest of ours by spelling is often another knob (--use-wandb was hinted --use-actor-fwd,
    --kl-loss-type --kl-loss-coef)."""
    typed = _flag(key.replace("-", "_"))
    theirs = [_flag(n) for n in aliases.table_names()]
    close = difflib.get_close_matches(typed, theirs, n=1, cutoff=0.8)
    close = close or difflib.get_close_matches(typed, [_flag(n) for n in _known_names()], n=1, cutoff=0.6)
    return f"{message} (did you mean {close[0]}?)" if close else message


def _scalar(raw: str) -> Any:
    if raw.lower() in ("none", "null"):
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    return value if isinstance(value, (int, float, bool, list, dict)) else raw


def _flatten_yaml(data: dict[str, Any], source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """{leaf: value} and {leaf: the key it was given under}, like the command line's (slime names too)."""
    index = flag_index()
    pairs: list[tuple[str, Any]] = []
    for key, value in data.items():
        k = key.replace("-", "_")
        if k in RelaxConfig.model_fields and isinstance(value, dict):
            pairs.extend((sub.replace("-", "_"), v) for sub, v in value.items())
        else:
            pairs.append((k, value))
    flat: dict[str, Any] = {}
    given: dict[str, str] = {}
    for k, value in pairs:
        try:
            if k in _MODE_FLAGS and value is True:
                flat["mode"] = _MODE_FLAGS[k]
            elif k in aliases.NO_EQUIVALENT:
                _refuse(k, value)
            elif k in aliases.MULTI_VALUE:
                values = value if isinstance(value, list) else [value]
                _put(flat, given, aliases.ALIASES.get(k, k), k, aliases.multi_value(k, values))
            elif k in aliases.SWITCHES or k in aliases.ENABLES:
                if not isinstance(value, bool):
                    raise ConfigError(f"{k!r} is an on/off flag: give true or false (got {value!r})")
                _switch(flat, given, k, value)
            elif aliases.ALIASES.get(k, k) in index:
                _put(flat, given, aliases.ALIASES.get(k, k), k, aliases.translate(k, value))
            else:
                raise ConfigError(_unknown(f"unknown key {k!r}", k))
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"{source}: {e}") from None
    return flat, given


def build_config(
    yaml_path: str | Path | None = None,
    argv: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> RelaxConfig:
    """defaults < YAML file (optional) < command-line overrides → validated config.

    Raises ConfigError naming the flag and the rule. ``notes``, if given, receives a line per name the
    user gave that means something else in slime or veRL (``--kl-coef``), for the console."""
    flat: dict[str, Any] = dict(defaults or {})
    given: dict[str, str] = {}
    if yaml_path is not None:
        path = Path(yaml_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} not found")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:  # (its message carries the line and column)
            raise ConfigError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: not UTF-8 (byte {e.start}); re-encode the config file as UTF-8"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of flag names to values")
        from_yaml, given = _flatten_yaml(data, str(path))
        flat.update(from_yaml)
    from_argv, on_argv = _parse(list(argv or []))
    flat.update(from_argv)
    given.update(on_argv)
    try:
        aliases.check_enabled(given, flat)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = config_from_flat(flat)
    if notes is not None:
        notes.extend(aliases.start_notes(given, flat))
    return cfg


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


def help_text(width: int | None = None, demos: dict[str, dict[str, Any]] | None = None) -> str:
    """Every flag with its default and docstring, grouped by section and wrapped to ``width`` columns (the
    terminal's by default): :mod:`relax_core.cli_help`. ``demos``: {label: the values that run sets over the
    defaults}, shown beside each default they change ("demo: 0.0002")."""
    from relax_core.cli_help import render

    return render(RelaxConfig, _default, width, demos)


def _default(f: Any) -> str:
    """A field's default as --help shows it: the value (a factory's too), or "required"."""
    if f.is_required():
        return "required"
    return f"default {f.get_default(call_default_factory=True)!r}"
