"""Rewards by name: a plain dict, a decorator, and dotted paths for user code.

Why a dict and not an if/elif chain: adding a reward must not mean editing a dispatcher. A reward
module registers its functions with ``@register("name")``; configs and per-sample metadata refer to
rewards by that name; user code that lives outside this package is named by dotted path
(``my_pkg.rewards:score`` or ``my_pkg.rewards.score``) and imported only when first asked for.
Third-party packages can also advertise rewards through the ``relax_rewards`` entry-point group::

    [project.entry-points.relax_rewards]
    my_reward = "my_pkg.rewards:score"

Built-in reward modules are imported lazily on the first lookup, so ``import relax_rewards`` stays
cheap (no sympy until a math reward actually runs).

An entry may be a sync function or an ``async def`` one; both take
``(response, label, metadata=None)``. See :mod:`relax_rewards.types`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

__all__ = [
    "ENTRY_POINT_GROUP",
    "REWARDS",
    "get_reward",
    "list_rewards",
    "register",
    "resolve_reward_type",
]

ENTRY_POINT_GROUP = "relax_rewards"
"""Entry-point group third-party packages use to publish rewards."""

REWARDS: dict[str, Callable] = {}
"""Name → reward function. Filled by ``@register`` as reward modules are imported."""

# Modules whose import registers the built-in rewards; imported on the first lookup.
_BUILTIN_MODULES: tuple[str, ...] = (
    "relax_rewards.math",
    "relax_rewards.choice",
    "relax_rewards.f1",
    "relax_rewards.format",
    "relax_rewards.ifeval",
    "relax_rewards.code",
    "relax_rewards.remote",
    "relax_rewards.genrm",
)
_builtins_loaded = False


def register(*names: str, overwrite: bool = False) -> Callable[[Callable], Callable]:
    """Decorator that registers a reward under one or more names and returns it unchanged.

    Registering a *different* function under a taken name is an error unless ``overwrite=True``
    (re-registering the same function, e.g. on module reload, is allowed).

    >>> @register("doc_example_const")
    ... def const(response, label, metadata=None):
    ...     return 1.0
    >>> get_reward("doc_example_const") is const
    True
    >>> _ = REWARDS.pop("doc_example_const")
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"register() needs one or more non-empty reward names (got {names!r})")

    def decorator(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"@register({names[0]!r}) must decorate a callable, not {fn!r}")
        for name in names:
            current = REWARDS.get(name)
            if current is not None and not overwrite and not _same_function(current, fn):
                raise ValueError(
                    f"reward name {name!r} is already registered to {_describe(current)}; "
                    f"pick another name or pass overwrite=True"
                )
            REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name_or_path: str | Callable) -> Callable:
    """Return the reward function for a registered name, an entry point, or a dotted path.

    Lookup order: registered names (built-ins loaded on first use), then entry points in the
    ``relax_rewards`` group, then a dotted path ``pkg.mod:fn`` / ``pkg.mod.fn``. A callable is
    returned as is. Unknown names raise ``KeyError`` listing what is registered.

    >>> get_reward("math").__name__
    'math_reward'
    >>> get_reward("relax_rewards.math:math_reward") is get_reward("math")
    True
    """
    if callable(name_or_path):
        return name_or_path
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise KeyError(f"a reward name must be a non-empty string (got {name_or_path!r})")
    name = name_or_path.strip()
    _load_builtins()
    if name in REWARDS:
        return REWARDS[name]
    fn = _load_entry_point(name)
    if fn is not None:
        return fn
    if "." in name or ":" in name:
        return _import_dotted(name)
    raise KeyError(
        f"unknown reward {name!r}; registered rewards: {', '.join(list_rewards()) or '(none)'}. "
        f"Register one with @relax_rewards.register({name!r}) or pass a dotted path 'pkg.module:fn'."
    )


def check_reward(name_or_path: str | Callable, flag: str = "--rm-type") -> Callable:
    """:func:`get_reward`, with every way it can fail as one ``ValueError`` line naming ``flag``: an unknown
    name, a module that does not import, an attribute that is missing or not callable, and a function that
    cannot be called as ``fn(response, label, metadata)``. For a run's pre-flight, before models load."""
    import inspect

    try:
        fn = get_reward(name_or_path)
    except KeyError as exc:
        raise ValueError(f"{flag} {name_or_path}: {exc.args[0] if exc.args else exc}") from None
    except Exception as exc:  # noqa: BLE001 - the module's own import error, a non-callable entry point
        raise ValueError(f"{flag} {name_or_path}: cannot load it ({type(exc).__name__}: {exc})") from None
    try:
        inspect.signature(fn).bind("", None, None)
    except TypeError as exc:
        raise ValueError(
            f"{flag} {name_or_path}: {_describe(fn)} cannot be called as fn(response, label, metadata) ({exc}); "
            "give it that signature (metadata may default to None)"
        ) from None
    except ValueError:  # (no signature to read, e.g. some builtins: the call will tell)
        pass
    return fn


def list_rewards() -> list[str]:
    """Sorted names of every known reward (registered and entry points)."""
    _load_builtins()
    names = set(REWARDS)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def resolve_reward_type(metadata: dict | None, default: str | Callable | None) -> str | Callable:
    """The reward to use for one sample: ``metadata["rm_type"]`` if set, else ``default``.

    Lets one dataset mix sources (math rows, multiple-choice rows, ...) under a single run.

    >>> resolve_reward_type({"rm_type": "dapo"}, "math")
    'dapo'
    >>> resolve_reward_type(None, "math")
    'math'
    >>> resolve_reward_type({"rm_type": ""}, "math")
    'math'
    """
    rm_type = (metadata or {}).get("rm_type")
    if rm_type:
        return rm_type
    if default is None:
        raise KeyError(
            "no reward type: the sample's metadata has no 'rm_type' and no default reward was given"
        )
    return default


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def _load_entry_point(name: str) -> Callable | None:
    matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not matches:
        return None
    fn = matches[0].load()
    if not callable(fn):
        raise TypeError(f"entry point {name!r} ({matches[0].value}) is not callable: {fn!r}")
    REWARDS.setdefault(name, fn)
    return fn


def _import_dotted(path: str) -> Callable:
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise KeyError(f"bad reward path {path!r}; expected 'pkg.module:fn' or 'pkg.module.fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KeyError(
            f"cannot import module {module_name!r} for reward {path!r}: {exc}; "
            f"registered rewards: {', '.join(list_rewards())}"
        ) from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise KeyError(f"module {module_name!r} has no attribute {attr!r} (reward {path!r})") from exc
    if not callable(obj):
        raise KeyError(f"reward {path!r} is not callable: {obj!r}")
    return obj


def _same_function(a: Callable, b: Callable) -> bool:
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", None)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
    )


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def call_reward(fn: Callable | str, response: str, label: Any, metadata: dict | None) -> Any:
    """Call a reward (a callable or a registered name), running it to completion if it is async."""
    if isinstance(fn, str):
        fn = get_reward(fn)
    from relax_rewards.types import is_async_reward

    if is_async_reward(fn):
        import asyncio

        return asyncio.run(fn(response, label, metadata))
    return fn(response, label, metadata)
