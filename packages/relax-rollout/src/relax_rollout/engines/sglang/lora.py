"""LoRA adapter serving on the ``sglang`` engine (``--lora-sync-mode adapter``): the servers keep the base
model and each weight update loads the trained adapter as a new, versioned SGLang adapter.

Why apart from :mod:`~relax_rollout.engines.sglang.weights`: a full-weight update replaces the one set of
weights every request uses; an adapter update adds one that new requests select by name (``lora_path``)
while requests already running keep theirs. That needs bookkeeping full weights do not — which adapter
versions are still in use, when an old one may go, what a restarted engine must load — and it is kept here.

How (SGLang 0.5.23, ``io_struct.py``, ``tokenizer_control_mixin.py``):

- **Launch.** ``--enable-lora --max-lora-rank R --lora-target-modules ...`` (a server started without an
  adapter needs both; peft's ``all-linear`` is SGLang's ``all``), and on a CPU ``--lora-backend
  torch_native`` (the others are Triton kernels). MoE experts' LoRA (peft's ``target_parameters``) runs
  only on SGLang's Triton MoE runner: refused on a CPU.
- **One path for every ``weight_update`` mode**: ``/load_lora_adapter_from_tensors`` with the tensors by
  value (a base64 pickle of host tensors, which SGLang's ``SafeUnpickler`` accepts). An adapter is small
  (megabytes where the model is gigabytes), so by value it needs no shared filesystem (``disk``), no CUDA
  IPC handle kept alive by the trainer (``tensor``) and no weight group (``distributed``), reaches engines
  on other nodes, and the host copy kept here is what a restarted engine is given.
- **Versions.** SGLang refuses to load a name it holds, so version ``v`` is ``{ADAPTER_NAME}_v{v}``. A
  request carries the newest version loaded on every serving engine when it is sent, and only after that
  load succeeded everywhere it did not fail the engine: no request sees a half-loaded adapter. Version 0
  (no update yet) is the base model (no ``lora_path``), which equals a fresh adapter (B = 0). Each engine's
  ``weight_version`` label is set with ``/update_weight_version``; a reply's version is the adapter's it was
  sent with (SGLang's per-token labels would name the newer version for tokens the old adapter sampled).
- **Unloading.** ``/unload_lora_adapter`` waits, inside SGLang's LoRA update lock, until no request uses
  the adapter. Sent while a request held paused in place (``--partial-rollout``) still used it, it would wait
  for a resume that the trainer only sends after this update returns — and block every later load behind
  that lock. So an old version is unloaded only once no request of ours uses it (counted here, as
  :meth:`SGLangAdapters.acquire` / :meth:`~SGLangAdapters.release`), in the background: a paused request
  keeps its adapter and finishes with it after the resume, labelled with its version.
- **Restarts.** A restarted engine loads every version still in use and the label before it rejoins the
  pool (:meth:`SGLangAdapters.restore`), so a request re-issued to it finds its adapter.
- **Validation.** A malformed tensor payload ends an SGLang server, so names, pairs, ranks and dtypes are
  checked before anything is sent (:func:`check_adapter`).
"""

from __future__ import annotations

import base64
import logging
import pickle
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from relax_core.lora import ADAPTER_NAME
from relax_rollout.engines.pool_members import PoolError
from relax_rollout.engines.processes import EngineProcess
from relax_rollout.engines.sglang.state import SGLangServers
from relax_rollout.engines.wire import ServerError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
"""peft's saved name of a LoRA tensor (the wire format, :mod:`relax_core.lora`)."""


def _flag(server_args: dict[str, Any], key: str) -> Any:
    """A launch flag given as ``key`` or ``--key-with-dashes``."""
    return server_args.get(key, server_args.get("--" + key.replace("_", "-")))


def lora_server_args(lora: dict[str, Any], server_args: dict[str, Any]) -> dict[str, Any]:
    """``server_args`` plus the flags that let an SGLang server started without an adapter load ``lora``'s
    (``adapter_config.json``'s fields): flags given already are kept."""
    out = dict(server_args)
    cpu = str(_flag(out, "device") or "") == "cpu"
    if lora.get("target_parameters") and cpu:
        raise ValueError(
            "LoRA on MoE experts (--lora-target-parameters) runs only on SGLang's Triton MoE runner, which a "
            "CPU server does not have: serve it on a GPU, drop --lora-target-parameters, or use "
            "--lora-sync-mode merged"
        )
    modules = lora.get("target_modules") or "all-linear"
    target = ["all"] if modules in ("all-linear", "all", ["all-linear"]) else list(modules)
    defaults: dict[str, Any] = {
        "enable_lora": True,
        "max_lora_rank": int(lora["r"]),
        "lora_target_modules": target,
    }
    if cpu:
        defaults["lora_backend"] = "torch_native"  # the other backends are Triton kernels
    for key, value in defaults.items():
        if _flag(out, key) is None:
            out[key] = value
    given = _flag(out, "max_lora_rank")
    if int(given) < int(lora["r"]):
        raise ValueError(
            f"sglang_server_args sets max_lora_rank {given} below the adapter's rank {lora['r']} (--lora-rank)"
        )
    return out


def adapter_name(version: int) -> str:
    """SGLang's name of adapter ``version`` (it refuses to reload a name it holds)."""
    return f"{ADAPTER_NAME}_v{version}"


def check_adapter(
    tensors: dict[str, Any], lora: dict[str, Any], previous: dict[str, tuple[int, ...]] | None = None
) -> dict[str, tuple[int, ...]]:
    """Refuse an adapter update SGLang would choke on (a malformed payload ends its server): every name is
    peft's saved name of a ``lora_A``/``lora_B`` weight, each A has its B, they are 2-D floating tensors of
    rank ``lora["r"]`` (A ``[r, in]``, B ``[out, r]``; experts' stacked ``[r*E, ...]`` with
    ``target_parameters``), on the target modules, and with the names and shapes of ``previous`` (the last
    update's). Returns the names' shapes."""
    import torch

    if not tensors:
        raise ValueError("an adapter update needs the adapter's tensors (got none)")
    r = int(lora["r"])
    modules = lora.get("target_modules") or "all-linear"
    explicit = None if isinstance(modules, str) else set(modules)
    stacked = bool(lora.get("target_parameters"))
    shapes: dict[str, tuple[int, ...]] = {}
    halves: dict[str, set[str]] = {}
    for name, t in tensors.items():
        m = _NAME.match(name)
        if m is None:
            raise ValueError(
                f"adapter tensor {name!r} is not peft's saved name of a LoRA weight "
                "('base_model.model.<module>.lora_A.weight'): send peft.get_peft_model_state_dict(model)"
            )
        module, ab = m["module"], m["ab"]
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"adapter tensor {name} must be a 2-D floating tensor (got {_describe(t)})")
        rank = t.shape[0] if ab == "A" else t.shape[1]
        if rank != r and not (stacked and rank % r == 0):
            raise ValueError(f"adapter tensor {name} has rank {rank}, the adapter's is {r} (--lora-rank)")
        leaf = module.rsplit(".", 1)[-1]
        if explicit is not None and leaf not in explicit and not stacked:
            raise ValueError(f"adapter tensor {name} is on {leaf}, not a target module ({sorted(explicit)})")
        halves.setdefault(module, set()).add(ab)
        shapes[name] = tuple(t.shape)
    unpaired = sorted(m for m, ab in halves.items() if ab != {"A", "B"})
    if unpaired:
        raise ValueError(f"adapter modules without both lora_A and lora_B: {unpaired[:3]}")
    if previous is not None and shapes != previous:
        changed = sorted(set(shapes) ^ set(previous) | {n for n in shapes if previous.get(n) != shapes[n]})
        raise ValueError(
            f"the adapter's tensors changed names or shapes since the last update: {changed[:3]}"
        )
    return shapes


def _describe(t: Any) -> str:
    return f"{type(t).__name__} {getattr(t, 'dtype', '')} {tuple(getattr(t, 'shape', ()))}".strip()


def serialize_adapter(tensors: dict[str, Any]) -> str:
    """One TP rank's ``serialized_named_tensors`` entry of ``/load_lora_adapter_from_tensors``: base64 of a
    pickle of ``{name: host tensor}`` — by value, so it crosses nodes, and of the kinds SGLang's
    ``SafeUnpickler`` (``MultiprocessingSerializer.deserialize``) allows; its worker loads the dict as is."""
    host = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
    return base64.b64encode(pickle.dumps(host, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


def load_adapter_request(name: str, config: dict[str, Any], payload: str, tp_size: int) -> dict[str, Any]:
    """SGLang's ``LoadLoRAAdapterFromTensorsReqInput``: ``config`` is ``adapter_config.json``'s fields
    (:func:`relax_core.lora.peft_config_dict`), one copy of ``payload`` per TP rank (each shards it)."""
    return {"lora_name": name, "config_dict": dict(config), "serialized_named_tensors": [payload] * tp_size}


def unload_adapter_request(name: str) -> dict[str, Any]:
    """SGLang's ``UnloadLoRAAdapterReqInput``."""
    return {"lora_name": name}


def weight_version_request(version: int) -> dict[str, Any]:
    """SGLang's ``UpdateWeightVersionReqInput``: only the label; requests are not aborted."""
    return {"new_version": str(version), "abort_all_requests": False}


@dataclass(eq=False)
class Adapter:
    """One loaded adapter version: its SGLang name, the host copy of its tensors (for restarted engines),
    and how many requests of ours use it."""

    version: int
    name: str
    payload: str
    users: int = 0


class SGLangAdapters:
    """The adapter versions ``servers`` hold (see the module docstring). ``config``: the adapter's
    ``adapter_config.json`` fields; ``check_version(v)``: every serving engine reports ``v``."""

    def __init__(
        self, servers: SGLangServers, config: dict[str, Any], check_version: Callable[[int], None]
    ) -> None:
        self.servers, self.config = servers, dict(config)
        self._check_version = check_version
        self._cond = threading.Condition(threading.RLock())  # guards current, _live, users
        self._update = threading.Lock()  # loads and restores, one at a time
        self.current: Adapter | None = None
        """The newest version loaded everywhere; None: version 0, the base model."""
        self._live: dict[str, Adapter] = {}
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self.last_payload_bytes = 0
        """The bytes one engine received for the last update (its request's serialized tensors)."""

    # -- requests ---------------------------------------------------------------------------------
    def acquire(self) -> Adapter | None:
        """The adapter a request sent now uses (None: the base model); :meth:`release` it when answered."""
        with self._cond:
            a = self.current
            if a is not None:
                a.users += 1
            return a

    def release(self, a: Adapter | None) -> None:
        """A request using ``a`` was answered: an old version no request uses any more is unloaded."""
        if a is None:
            return
        with self._cond:
            a.users -= 1
            stale = a is not self.current and a.users == 0 and self._live.pop(a.name, None) is not None
        if stale:
            self._unload_later(a)

    # -- updates ----------------------------------------------------------------------------------
    def update(self, tensors: dict[str, Any], version: int) -> None:
        """Load ``tensors`` (the wire format, :mod:`relax_core.lora`) as adapter ``version`` on every
        serving engine; new requests use it once it loaded. An engine that did not load it is failed (the
        supervisor restarts it with the live adapters); :class:`WeightUpdateFailed` when none did."""
        from relax_rollout.engines.sglang.weights import WeightUpdateFailed

        s = self.servers
        with self._update:
            name = adapter_name(version)
            with self._cond:
                if name in self._live:
                    raise ValueError(
                        f"adapter version {version} is loaded already: each update needs a new one"
                    )
            shapes = check_adapter(tensors, self.config, self._shapes)
            payload = serialize_adapter(tensors)
            body = load_adapter_request(name, self.config, payload, s.tp_size)
            urls = [m.url for m in s.pool.membership.active()]
            if not urls:
                raise PoolError(f"no active SGLang engine to load adapter version {version}: {s.describe()}")
            failed = self._each(urls, "/load_lora_adapter_from_tensors", body)
            loaded = [u for u in urls if u not in failed]
            failed |= self._each(loaded, "/update_weight_version", weight_version_request(version))
            if len(failed) == len(urls):
                raise WeightUpdateFailed(
                    f"no engine loaded adapter version {version}: {'; '.join(failed.values())}"
                )
            adapter = Adapter(version, name, payload)
            with self._cond:
                old, self.current = self.current, adapter
                self._live[name] = adapter
                stale = old is not None and old.users == 0 and self._live.pop(old.name, None) is not None
            self._shapes, self.last_payload_bytes = shapes, len(payload)
            s.pool.adopt_weights(version, None)
        if stale:
            assert old is not None
            self._unload_later(old)
        self._check_version(version)

    def restore(self, slot: EngineProcess, join: Callable[[EngineProcess], None]) -> None:
        """A restarted engine (not serving yet) loads every adapter version in use and the current version's
        label, then ``join(slot)`` adds it to the pool — under the update lock, so no update can slip in
        between and leave it an adapter behind."""
        s = self.servers
        assert slot.url is not None
        with self._update:
            with self._cond:
                live = sorted(self._live.values(), key=lambda a: a.version)
                current = self.current
            for a in live:
                body = load_adapter_request(a.name, self.config, a.payload, s.tp_size)
                s.call(slot.url, "/load_lora_adapter_from_tensors", body)
            if current is not None:
                s.call(slot.url, "/update_weight_version", weight_version_request(current.version))
            join(slot)

    # -- the engines --------------------------------------------------------------------------------
    def _each(self, urls: list[str], path: str, body: dict[str, Any]) -> dict[str, str]:
        """``path`` on each of ``urls`` concurrently; an engine that fails it (a refusal — SGLang's
        answer to a load that failed part-way — a 5xx, a reset, a time-out) is marked failed: ``{url: why}``."""
        s = self.servers
        futs: list[tuple[str, Future]] = [(u, s.executor.submit(s.call, u, path, body)) for u in urls]
        failed: dict[str, str] = {}
        for url, f in futs:
            try:
                f.result()
            except (ServerError, OSError) as x:
                failed[url] = f"{path} failed: {type(x).__name__}: {x}"
                m = s.pool.membership.find(url)
                if m is not None and m.state == "active":
                    s.pool.membership.mark_failed(m.id, failed[url])  # the supervisor restarts it
        return failed

    def _unload_later(self, a: Adapter) -> None:
        """Unload ``a`` from every serving engine in the background (no request of ours uses it, so
        SGLang's drain has nothing to wait for); one that does not hold it (restarted since) refuses."""
        s = self.servers

        def unload() -> None:
            for m in s.pool.membership.active():
                try:
                    s.call(m.url, "/unload_lora_adapter", unload_adapter_request(a.name))
                except Exception as x:  # noqa: BLE001 — a leftover adapter costs memory, not correctness
                    logger.warning("unloading adapter %s from %s: %s", a.name, m.url, x)

        if not s.closed:
            s.executor.submit(unload)
