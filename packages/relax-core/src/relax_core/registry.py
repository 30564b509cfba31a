"""Names of pluggable parts and where they live: the one registry of relax-core and the packages built on it
(roles and the evaluator, training and value backends, rollout engines).

Why one mechanism: a part is chosen by a name in the config (``--rollout-backend sglang``), its code may need
heavy libraries (SGLang, megatron-core) that must not load until it is built, and another package must be
able to add one without editing ours. So a :class:`Registry` maps names to ``"module:attr"`` strings —
built-ins given where the registry is declared, more from installed packages under its entry-point group —
and imports only in :meth:`Registry.load`::

    [project.entry-points."relax.rollout_engines"]
    my_engine = "my_pkg.engine:MyEngine"

A name given twice (a built-in and a package, or two packages) is refused, naming both. (The standalone
packages keep their own, as they depend on nothing of ours: rewards by decorator, entry point or dotted
path, ``relax_rewards.registry``; the bus's samplers, ``relax_bus.samplers.register_sampler``.)
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator, MutableMapping
from importlib import metadata
from typing import Any


class Registry(MutableMapping[str, Any]):
    """Name -> ``"module:attr"`` (built-ins first, then installed packages by distribution and name), or an
    object code put in (``registry[name] = factory``: a test's, a notebook's; it replaces one of that name)."""

    def __init__(
        self,
        what: str,
        group: str,
        builtins: dict[str, str] | None = None,
        hints: dict[str, str] | None = None,
    ) -> None:
        """``what``: how errors call it (the flag that picks one: ``--train-backend``); ``group``: the
        entry-point group packages add to; ``hints``: for a name whose code needs a library that is missing, what to install
        (``{"megatron": "megatron-core: pip install 'relax-train[megatron]'"}``)."""
        self.what, self.group = what, group
        self.builtins = dict(builtins or {})
        self.hints = dict(hints or {})

    @functools.cached_property
    def _entries(self) -> dict[str, tuple[Any, str]]:
        """name -> (``module:attr`` or the object, where it comes from), read once."""
        out = {name: (target, "relax") for name, target in self.builtins.items()}
        eps = sorted(metadata.entry_points(group=self.group), key=lambda e: (_dist(e), e.name))
        for ep in eps:
            if ep.name in out and out[ep.name][0] != ep.value:
                raise RuntimeError(
                    f"{self.what} {ep.name!r} is registered twice ({out[ep.name][0]} from {out[ep.name][1]} and "
                    f"{ep.value} from {_dist(ep)}): uninstall one of the packages registering `{ep.name}` under "
                    f"the {self.group} entry points"
                )
            out[ep.name] = (ep.value, _dist(ep))
        return out

    def __getitem__(self, name: str) -> Any:
        return self._entries[name][0]

    def __setitem__(self, name: str, target: Any) -> None:
        self._entries[name] = (target, "code")

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, name: str) -> Any:
        """The class or factory registered as ``name``, its module imported now."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.what} {name!r}; available: {sorted(self._entries)}")
        target, source = self._entries[name]
        if not isinstance(target, str):
            return target
        module, _, attr = target.partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as e:
            missing = e.name or ""
            if name in self.hints and not missing.startswith(module.split(".")[0]):
                raise ImportError(f"{self.what} {name} needs {self.hints[name]}") from e
            raise ImportError(
                f"{self.what} {name} = {target} (from {source}) does not import ({e}): install what it needs, "
                "or reinstall that package (`uv sync` in a checkout)"
            ) from e
        for part in attr.split(".") if attr else []:
            obj = getattr(obj, part)
        return obj


def _dist(ep: metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else ""
