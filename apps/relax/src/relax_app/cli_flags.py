"""The command line's names, parsed by pydantic-settings: our config's leaves and slime's / veRL's names.

pydantic-settings builds the parser (argparse underneath, no abbreviations) from a pydantic model of every
name the command line takes, each typed by what it is: an on/off flag (``--x`` / ``--no-x``), a flag with
one value, or one with several (slime's ``nargs="+"``: ``--rollout-stop '</answer>' '###'``). What it does
not know comes back in order, for :mod:`relax_app.cli_config` to read (config files, ``key=value``
overrides) or to report with every other problem at once. Values are kept as typed, to be read as YAML
values are (pydantic-settings' own list decoding splits at commas and unquotes: a stop string must stay
exactly what was typed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

from relax_app import cli_aliases as aliases
from relax_core.config import RelaxConfig

Kind = Literal["switch", "one", "many"]

MODE_FLAGS = {"colocate": "colocate", "fully_async": "fully_async"}
"""On/off flags that pick ``--mode``."""


@cache
def flag_index() -> dict[str, tuple[str, str]]:
    """Map every flag name (``micro_batch_size``) to its (section, field). (Read-only: built once.)"""
    index: dict[str, tuple[str, str]] = {}
    for section, info in RelaxConfig.model_fields.items():
        for name in info.annotation.model_fields:  # type: ignore[union-attr]
            if name in index:
                raise AssertionError(f"duplicate config leaf {name!r}")
            index[name] = (section, name)
    return index


def annotation(leaf: str) -> Any:
    """The type of our leaf ``leaf``."""
    section, name = flag_index()[leaf]
    return RelaxConfig.model_fields[section].annotation.model_fields[name].annotation  # type: ignore[union-attr]


def is_bool(leaf: str) -> bool:
    return annotation(leaf) in (bool, bool | None)


def is_text(leaf: str) -> bool:
    return annotation(leaf) in (str, str | None)


def is_list(leaf: str) -> bool:
    return getattr(annotation(leaf), "__origin__", None) is list


@cache
def kinds() -> dict[str, Kind]:
    """Every name the command line takes -> how many values it takes. Where a name is in two tables, the
    first kind below wins (slime's meaning of a name it shares with ours is in cli_aliases' tables)."""
    out: dict[str, Kind] = {}
    for leaf in flag_index():
        out[leaf] = "switch" if is_bool(leaf) else "many" if is_list(leaf) else "one"
    for alias, leaf in aliases.ALIASES.items():
        out[alias] = out[leaf]
    out |= dict.fromkeys(MODE_FLAGS, "switch")
    out |= dict.fromkeys([*aliases.SWITCHES, *aliases.ENABLES, *aliases.REFUSED_SWITCHES], "switch")
    out |= dict.fromkeys(aliases.CONVERTS, "one")
    # several values, or none: slime's names accepted whatever they carry (refused or unused) and lists
    out |= dict.fromkeys([*aliases.MULTI_VALUE, *aliases.NO_EQUIVALENT, *aliases.IGNORED], "many")
    return out


@cache
def _parser() -> Any:
    """The argparse parser pydantic-settings builds from a model of :func:`kinds` (built once: ~250 names)."""
    from pydantic import create_model
    from pydantic_settings import BaseSettings, CliSettingsSource, CliVariadicArg, SettingsConfigDict

    class Names(BaseSettings):
        model_config = SettingsConfigDict(
            cli_kebab_case=True,
            cli_implicit_flags=True,  # an on/off name is --x / --no-x
            cli_exit_on_error=False,  # a parse error is a SettingsError, not an exit
            cli_enforce_required=False,
            protected_namespaces=(),  # (slime's --model-path)
        )

    typed = {"switch": (bool, None), "one": (str, None), "many": (CliVariadicArg[list[str]], None)}
    fields: dict[str, Any] = {name: typed[kind] for name, kind in kinds().items()}
    fields["config"] = (list[str], None)  # --config FILE, repeatable
    model = create_model("CommandLineNames", __base__=Names, **fields)
    return CliSettingsSource(model).root_parser


@dataclass
class Read:
    """What the parser made of a command line: ``values`` {name: as typed: text, a bool, or a list of
    texts}, in the order given; ``rest``: what it does not know, in order; ``errors``: one line each."""

    values: dict[str, Any] = field(default_factory=dict)
    rest: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def read(argv: list[str]) -> Read:
    """Parse ``argv``; a flag missing its value is an error of its own, and the others are still read."""
    out = Read()
    argv = _normalise(argv, out.errors)
    from pydantic_settings import SettingsError

    try:
        namespace, out.rest = _parser().parse_known_args(argv)
    except SettingsError as e:  # (what _normalise does not foresee: named, with the rest unread)
        out.errors.append(str(e).removeprefix("error parsing CLI: "))
        return out
    out.values = vars(namespace)
    return out


def _normalise(argv: list[str], errors: list[str]) -> list[str]:
    """``argv`` as the parser takes it: ``--a_b`` (TRL's spelling) as ``--a-b``; an on/off flag's
    ``true``/``false`` (``--x false``, ``--x=true``) as ``--x`` / ``--no-x``; a flag of one value with none
    (the last argument, or followed by a flag) reported and left out."""
    kind = kinds()
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("-h", "--help"):
            errors.append(f"{arg}: give it alone (relax train --help) to list the flags")
            continue
        if not arg.startswith("--"):
            out.append(arg)
            continue
        key, eq, inline = arg[2:].partition("=")
        key = key.replace("_", "-")
        name = key.replace("-", "_")
        negated = name.startswith("no_") and kind.get(name[3:]) == "switch" and name not in kind
        base = name[3:] if negated else name
        if kind.get(base) == "switch":
            word = (
                inline if eq else argv[i] if i < len(argv) and argv[i].lower() in ("true", "false") else None
            )
            if word is not None and word.lower() not in ("true", "false"):
                errors.append(f"--{key} is an on/off flag: give it bare, or true / false (got {word!r})")
                continue
            i += 0 if eq or word is None else 1
            on = (word is None or word.lower() == "true") != negated
            if base in aliases.REFUSED_SWITCHES and not on:
                continue  # (slime's --no-load-optim false asks for nothing; given, it is refused)
            out.append("--" + ("" if on else "no-") + base.replace("_", "-"))
            continue
        if (kind.get(name) == "one" or name == "config") and not eq:
            text = name in flag_index() and is_text(name)  # (--output-dir may be given "--x")
            if i >= len(argv) or (argv[i].startswith("--") and not text):
                errors.append(f"--{key} needs a value" + (" (a YAML config)" if name == "config" else ""))
                continue
            eq, inline = "=", argv[i]  # (as --key=value: argparse takes "-1e-3" for a flag)
            i += 1
        out.append(f"--{key}{eq}{inline}")
    return out
