"""The weight update group an engine server joined (``/init_weights_update_group``): SGLang's group, whose
``/update_weights_from_distributed`` requests each take their tensors from rank 0's broadcast, or the
trainer's DCS group (``"protocol": "relax_dcs"``), whose background receiver applies every version pushed.
A part of :class:`~relax_rollout.server.state.EngineServer` that owns the group's state.
"""

from __future__ import annotations

import time
from typing import Any

from relax_rollout.engines.base import RolloutEngine
from relax_rollout.server import protocol
from relax_rollout.server.protocol import BadRequest


def next_version(engine: RolloutEngine, requested: Any, field_name: str = "weight_version") -> int:
    """The version a weight update takes: ``requested``, or the engine's next when the request names none."""
    if requested is None:
        return engine.weight_version + 1
    try:
        return int(requested)
    except (TypeError, ValueError):
        raise BadRequest(field_name, f"must be an integer version (got {requested!r})") from None


def apply_weights(
    engine: RolloutEngine, tensors: dict[str, Any], requested: Any, field_name: str, mismatch: str
) -> int:
    """Load ``tensors`` into ``engine`` at their version (:func:`next_version` of ``requested``); a name the
    served model lacks is a 400 on ``field_name`` that says ``mismatch``. The version applied."""
    v = next_version(engine, requested)
    try:
        engine.update_weights(tensors, v)
    except KeyError as e:
        raise BadRequest(field_name, f"{mismatch}: {e}") from None
    return v


class JoinedGroup:
    """The group this server joined, if any, and the weights held back until a request applies them."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self._receiver: Any = None
        """relax DCS: the background :class:`~relax_core.dcs.WeightReceiver`."""
        self._pg: Any = None
        """SGLang's group: the process group rank 0 broadcasts over."""
        self._pending: dict[str, Any] = {}
        """SGLang's group: tensors received and not yet applied."""
        self._group_name: str | None = None

    def join(self, body: dict) -> None:
        """``/init_weights_update_group``: join rank 0's group as ``rank_offset`` — SGLang's group
        (:mod:`relax_rollout.engines.weight_group`; each ``/update_weights_from_distributed`` then takes
        its tensors from a broadcast), or with ``"protocol": "relax_dcs"`` (a relax extension) the
        trainer's DCS group, whose sender pushes every version."""
        for key in ("master_address", "master_port", "rank_offset", "world_size"):
            if key not in body:
                raise BadRequest(key, "is required")
        for key in ("master_port", "rank_offset", "world_size"):
            if not isinstance(body[key], int) or isinstance(body[key], bool):
                raise BadRequest(key, f"must be an integer (got {body[key]!r})")
        backend = body.get("backend", "gloo")
        if backend not in ("gloo", "nccl"):
            raise BadRequest("backend", f"must be 'gloo' or 'nccl' (got {backend!r})")
        proto = body.get("protocol", "sglang")
        if proto not in ("sglang", "relax_dcs"):
            raise BadRequest("protocol", f"must be 'sglang' (default) or 'relax_dcs' (got {proto!r})")
        if self._receiver is not None or self._pg is not None:
            raise BadRequest("group_name", "a weight update group is already initialised; destroy it first")
        if not 1 <= body["rank_offset"] < body["world_size"]:
            raise BadRequest(
                "rank_offset",
                f"must be in 1..world_size-1 (rank 0 sends; got {body['rank_offset']} of "
                f"{body['world_size']})",
            )
        name = body.get("group_name", "weight_update_group")
        init = f"tcp://{body['master_address']}:{body['master_port']}"
        if proto == "sglang":
            from relax_rollout.engines.weight_group import new_group

            timeout = protocol._num(body, "timeout_s", "body", float, 300.0, lo=1.0)
            # rendezvous with rank 0 (this server's engine has one rank: tensor parallelism is SGLang's)
            self._pg = new_group(backend, init, body["world_size"], body["rank_offset"], name, timeout)
            self._pending = {}
            self._group_name = name
            return
        from relax_core.dcs import WeightReceiver

        try:
            rcv = WeightReceiver(
                init, body["world_size"], body["rank_offset"], backend=backend, group_name=name
            )
        except ValueError as e:
            raise BadRequest("rank_offset", str(e)) from None
        rcv.connect()  # rendezvous with the trainer's WeightSender
        rcv.start_background(lambda v, t: self.engine.update_weights(t, v))
        self._receiver = rcv
        self._group_name = name

    @property
    def receives_broadcast(self) -> bool:
        """Joined SGLang's weight group: each ``/update_weights_from_distributed`` takes its tensors from
        rank 0's broadcast (:meth:`receive`); else (relax DCS, or no group) a background receiver
        applies the versions pushed and the request waits for its own (:meth:`wait_for_version`)."""
        return self._pg is not None

    def check(self, group_name: Any) -> None:
        """A request naming a weight update group must name the one this server joined."""
        if group_name is None or (self._receiver is None and self._pg is None):
            return
        if group_name != self._group_name:
            raise BadRequest(
                "group_name",
                f"no weight update group {group_name!r}; this server joined {self._group_name!r}",
            )

    def receive(self, body: dict, apply: bool) -> int | None:
        """SGLang's group: take the tensors ``body`` names from rank 0's broadcast. They are applied with
        the request that carries ``weight_version`` or ``flush_cache`` (``apply``), together with those of
        the requests before it: MoE experts sent one per expert may span buckets and this engine loads
        them fused. Returns the version applied, or None while held."""
        from relax_rollout.engines.weight_group import receive

        names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
        try:
            got = receive(self._pg, names, dtypes, shapes, body.get("load_format"))
        except ValueError as e:
            raise BadRequest("dtypes", str(e)) from None
        self._pending.update(got)
        if not apply:
            return None
        tensors, self._pending = self._pending, {}
        return apply_weights(
            self.engine, tensors, body.get("weight_version"), "names", "weights do not match the served model"
        )

    def wait_for_version(self, version: Any, timeout_s: float) -> int:
        """DCS pushes the weights itself (a background receiver); this waits until ``version`` is applied."""
        if self._receiver is None:
            raise BadRequest("group_name", "no weight update group: call /init_weights_update_group first")
        want = next_version(self.engine, version)
        deadline = time.monotonic() + timeout_s
        while self.engine.weight_version < want:
            self._receiver.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight version {want} not received within {timeout_s}s")
            time.sleep(0.01)
        return self.engine.weight_version

    def leave(self) -> None:
        """``/destroy_weights_update_group``: leave the group (a server that joined none: nothing to do)."""
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        if self._pg is not None:
            from relax_rollout.engines.weight_group import destroy_group

            destroy_group(self._pg)
            self._pg, self._pending = None, {}
