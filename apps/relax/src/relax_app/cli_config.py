"""Config from YAML plus command-line overrides, with errors that name the flag.

Every leaf field of :class:`RelaxConfig` is a flag: ``train.micro_batch_size`` is ``--micro-batch-size``.
Leaf names are unique across sections, so users never type the section. YAML files may be nested by
section (``train: {lr: 1e-5}``) or flat (``lr: 1e-5``). slime's names for the same knobs are accepted too
(:mod:`relax_app.cli_aliases`), and an unknown flag names the closest known one. The command line is parsed
by pydantic-settings (:mod:`relax_app.cli_flags`); its names and a YAML file's keys are read alike here.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from relax_app import cli_aliases as aliases
from relax_app import cli_flags
from relax_app.cli_flags import flag_index
from relax_core.config import RelaxConfig


class ConfigError(ValueError):
    """An invalid config value; the message names the flag and the rule."""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_overrides(argv: list[str]) -> dict[str, Any]:
    """Turn ``--flag value`` / ``--flag=value`` / bare boolean flags into {leaf: value}."""
    parsed = _parse(argv)
    _raise_all(parsed.errors)
    return parsed.flat


CONFIG_SUFFIXES = (".yaml", ".yml")
"""A bare argument with one of these endings is a config file (anywhere on the command line)."""


@dataclass
class Parsed:
    """What a command line gives: ``flat`` {leaf: value}, ``given`` {leaf: the name it was given under (ours,
    or a slime alias: cli_aliases)}, ``files`` (config files: bare ``*.yaml`` arguments and ``--config``, in
    order), ``errors`` (every problem, each naming its flag: reported together)."""

    flat: dict[str, Any] = field(default_factory=dict)
    given: dict[str, str] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def config_files(argv: list[str]) -> list[str]:
    """The config files a command line names (bare ``*.yaml`` arguments and ``--config FILE``), in order."""
    return _parse(argv).files


def _raise_all(errors: list[str]) -> None:
    """One ``ConfigError`` for every problem found (one line each), so a script is fixed in one go."""
    if len(errors) == 1:
        raise ConfigError(errors[0])
    if errors:
        listed = "\n".join(f"  {e}" for e in errors)
        raise ConfigError(
            f"{len(errors)} problems with the command line:\n{listed}\nsee `relax train --help`"
        )


def _parse(argv: list[str]) -> Parsed:
    """:class:`Parsed` of ``argv``: the names pydantic-settings knows (cli_flags), read as a YAML file's keys
    are; then what it does not know, in order (config files, ``key=value`` overrides, unknown flags)."""
    read = cli_flags.read(argv)
    out = Parsed(errors=read.errors)
    bare: list[str] = []
    for name, typed in read.values.items():
        if name == "config":
            out.files += typed
            continue
        if cli_flags.kinds()[name] == "many":
            typed, tail = _split_tail(typed)
            bare += tail  # (a config file or an override after a flag's values: not one of them)
        try:
            _apply(name, _decode(name, typed), out.flat, out.given, _flag)
        except (ConfigError, ValueError) as e:
            out.errors.append(str(e))
    _rest([*read.rest, *bare], out)
    out.files = _in_order(argv, out.files)
    return out


def _split_tail(values: list[str]) -> tuple[list[str], list[str]]:
    """A several-value flag's values, and from the first config file or ``key=value`` override on, what
    the command line gave after them."""
    for i, v in enumerate(values):
        if _is_bare_arg(v):
            return values[:i], values[i:]
    return values, []


def _is_bare_arg(arg: str) -> bool:
    """A config file, or a ``key=value`` override whose key is one we read (a stop string may hold "=")."""
    if arg.endswith(CONFIG_SUFFIXES):
        return True
    key, eq, _ = arg.partition("=")
    if not eq or arg.startswith("-"):
        return False
    try:
        return aliases.dotted(key.strip(), None)[0] in flag_index()
    except ValueError:
        return key in aliases.DOTTED_REFUSED


def _in_order(argv: list[str], files: list[str]) -> list[str]:
    """``files`` in the order the command line names them (later files win)."""
    tokens = [a.removeprefix("--config=") for a in argv]
    return [t for t in tokens if t in files]


def _rest(rest: list[str], out: Parsed) -> None:
    """What the parser does not know: config files, overrides, and unknown flags (each with its values)."""
    i = 0
    while i < len(rest):
        arg = rest[i]
        i += 1
        if not arg.startswith("-"):
            _bare(arg, out)
            continue
        key = arg.lstrip("-").partition("=")[0]
        out.errors.append(_unknown(f"unknown flag --{key}", key))
        while i < len(rest) and not rest[i].startswith("-") and not _is_bare_arg(rest[i]):
            i += 1  # (its values)


def _bare(arg: str, out: Parsed) -> None:
    """A bare argument where a flag was expected: a config file, or a veRL-style ``a.b.c=value`` override."""
    if arg.endswith(CONFIG_SUFFIXES):
        out.files.append(arg)
    elif "=" in arg:
        path, _, raw = arg.partition("=")
        try:
            leaf, value = aliases.dotted(path.strip(), _scalar(raw))
            if leaf not in flag_index():
                raise ValueError(f"{path}={raw}: unknown key; give our flag (see --help)")
            if cli_flags.is_text(leaf) and isinstance(value, int | float) and not isinstance(value, bool):
                value = raw  # (a text field keeps its text: output_dir=2024)
            _put(out.flat, out.given, leaf, path, value)
        except (ConfigError, ValueError) as e:
            out.errors.append(str(e))
    else:
        out.errors.append(
            f"unexpected argument {arg!r}: flags look like --name value, a config file ends in .yaml, an "
            "override looks like key=value"
        )


def _decode(name: str, typed: Any) -> Any:
    """A command-line value as the same value in a YAML file: ``--lr 1e-5`` a number, ``--rollout-stop '["a",
    "b"]'`` a list; a text field keeps its text (``--output-dir 2024``), ``none``/``null`` being None where
    None is allowed (``--rm-type none`` names the no-reward reward)."""
    kind = cli_flags.kinds()[name]
    if kind == "switch":
        return True if name in aliases.REFUSED_SWITCHES else typed  # (given at all: refused)
    if kind == "many":
        leaf = aliases.ALIASES.get(name, name)
        if leaf in flag_index() and len(typed) == 1 and typed[0].lstrip().startswith(("[", "{")):
            return _yaml_list(name, typed[0])
        if name in aliases.NO_EQUIVALENT:
            return _scalar(typed[0]) if len(typed) == 1 else typed or None
        return typed
    leaf = aliases.ALIASES.get(name, name)
    if leaf in flag_index() and cli_flags.is_text(leaf):
        nullable = cli_flags.annotation(leaf) is not str
        return None if nullable and typed.lower() in ("none", "null") else typed
    return typed if name in aliases.CONVERTS else _scalar(typed)


def _yaml_list(name: str, text: str) -> list[Any]:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        value = None
    if not isinstance(value, list):
        raise ConfigError(f"{_flag(name)}: {text!r} is not a YAML list")
    return value


def _apply(k: str, value: Any, flat: dict[str, Any], given: dict[str, str], spell: Any) -> None:
    """Name ``k`` (ours or one of cli_aliases' tables) given ``value``, into ``flat`` / ``given``: the same
    for a command line and a config file. ``spell`` writes the name as the user wrote it, for errors."""
    if k in cli_flags.MODE_FLAGS:
        if value is True:
            flat["mode"] = cli_flags.MODE_FLAGS[k]
    elif k in aliases.IGNORED:
        given[k] = k
    elif k in aliases.REFUSED_SWITCHES:
        if value is not False:
            raise ConfigError(f"{spell(k)}: no equivalent in relax; {aliases.REFUSED_SWITCHES[k]}")
    elif k in aliases.CONVERTS:
        field_name, convert = aliases.CONVERTS[k]
        _put(flat, given, field_name, k, convert(value))
    elif k in aliases.NO_EQUIVALENT:
        _refuse(k, value)
    elif k in aliases.MULTI_VALUE:
        values = value if isinstance(value, list) else [value]
        _put(flat, given, aliases.ALIASES.get(k, k), k, aliases.multi_value(k, values))
    elif k in aliases.SWITCHES or k in aliases.ENABLES:
        if not isinstance(value, bool):
            raise ConfigError(f"{spell(k)} is an on/off flag: give true or false (got {value!r})")
        _switch(flat, given, k, value)
    elif aliases.ALIASES.get(k, k) in flag_index():
        _put(flat, given, aliases.ALIASES.get(k, k), k, aliases.translate(k, value))
    else:
        raise ConfigError(_unknown(f"unknown key {k!r}", k))


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
        shown = "" if value is None else f" {value!r}"
        raise ConfigError(f"{_flag(name)}{shown}: no equivalent in relax; {aliases.NO_EQUIVALENT[name]}")


def _known_names() -> list[str]:
    bools = [f"no_{name}" for name, kind in cli_flags.kinds().items() if kind == "switch"]
    return [*cli_flags.kinds(), *bools]


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


def _flatten_yaml(
    data: dict[str, Any], source: str, errors: list[str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """{leaf: value} and {leaf: the key it was given under}, like the command line's (slime names too); a
    key that cannot be used is added to ``errors`` (named with ``source``) and the others read."""
    pairs: list[tuple[str, Any]] = []
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k in RelaxConfig.model_fields and isinstance(value, dict):
            pairs.extend((str(sub).replace("-", "_"), v) for sub, v in value.items())
        else:
            pairs.append((k, value))
    flat: dict[str, Any] = {}
    given: dict[str, str] = {}
    for k, value in pairs:
        try:
            _apply(k, value, flat, given, repr)
        except (ConfigError, ValueError) as e:
            errors.append(f"{source}: {e}")
    return flat, given


def _read_yaml(path: Path) -> dict[str, Any]:
    """A config file's mapping; ``ConfigError`` naming the file and what is wrong with it."""
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
    return data


def build_config(
    yaml_path: str | Path | None = None,
    argv: list[str] | None = None,
    defaults: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> RelaxConfig:
    """defaults < YAML files (``yaml_path``, then those ``argv`` names, in order) < command-line overrides →
    validated config.

    Raises one ConfigError naming every flag, key and file that cannot be used, each with the rule.
    ``notes``, if given, receives a line per name the user gave that means something else in slime or veRL
    (``--kl-coef``) or that relax accepts and does not use (slime's ``--num-layers``), for the console."""
    parsed = _parse(list(argv or []))
    errors = list(parsed.errors)
    flat: dict[str, Any] = dict(defaults or {})
    given: dict[str, str] = {}
    files = ([str(yaml_path)] if yaml_path is not None else []) + parsed.files
    for name in files:
        try:
            from_yaml, named = _flatten_yaml(_read_yaml(Path(name)), name, errors)
        except ConfigError as e:
            errors.append(str(e))
            continue
        flat.update(from_yaml)
        given.update(named)
    flat.update(parsed.flat)
    given.update(parsed.given)
    _raise_all(errors)
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
    terminal's by default): :mod:`relax_app.cli_help`. ``demos``: {label: the values that run sets over the
    defaults}, shown beside each default they change ("demo: 0.0002")."""
    from relax_app.cli_help import render

    return render(RelaxConfig, _default, width, demos)


def _default(f: Any) -> str:
    """A field's default as --help shows it: the value (a factory's too), or "required"."""
    if f.is_required():
        return "required"
    return f"default {f.get_default(call_default_factory=True)!r}"
