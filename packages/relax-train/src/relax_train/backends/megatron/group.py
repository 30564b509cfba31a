"""A megatron trainer of several ranks inside a run.

A role (trainer, ActorFwd, reference) is one Ray actor; with model parallelism its backend needs one
process per rank. This process becomes rank 0 and starts ranks 1..N-1 as Ray actors it owns (they die
with it, so a restarted role starts a fresh group); every backend call runs on all ranks at once, and
the role sees rank 0's answer. Each rank is a GPU (``--actor-num-nodes`` × ``--actor-num-gpus-per-node``),
rank 0's included: a placement group reserves one GPU per rank, so Ray gives no other actor the GPU this
process trains on. On several nodes (a Ray cluster the run connects to) the ranks follow the nodes: rank 0
on this process's node, then node by node (:func:`place_ranks`). On a machine without CUDA the ranks are
CPU processes (gloo), which is how CI runs a tensor-parallel trainer.

In colocate mode every role lives in the controller's process, and megatron's parallel state is per
process: the reference (or teacher) model is built on the trainer's ranks, next to the trainer's model,
instead of on a second group.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from relax_core.config import RelaxConfig

logger = logging.getLogger(__name__)


def world_size(config: RelaxConfig) -> int:
    t = config.train
    return max(1, t.actor_num_nodes * t.actor_num_gpus_per_node)


_RANKS: _Ranks | None = None
"""This process's rank group (it is rank 0), shared by every model built here: in colocate mode the
trainer and the reference live in one process, and megatron's parallel state is per process."""


def build_megatron(config: RelaxConfig, model_path: str, trainable: bool = True):
    """The registry's factory: one process's :class:`MegatronBackend`, or a :class:`MegatronRankGroup`
    when the run gives the trainer several ranks and this process is not already one of them. A second
    model built in a process that leads a rank group (colocate: the reference next to the trainer) is
    built on the same ranks."""
    from relax_train.backends.megatron.backend import MegatronBackend

    global _RANKS
    if _RANKS is not None:
        return _RANKS.model(config, model_path, trainable)
    world = world_size(config)
    if "WORLD_SIZE" in os.environ or (world == 1 and not _ray_gpus()):
        return MegatronBackend(config, model_path, trainable)  # a launcher (torchrun, tests) set the ranks
    # (one rank on a GPU inside a Ray cluster, too: its GPU is reserved through Ray like any rank's, so
    # no other role of a fully-async run — SGLang's engines included — is given it)
    _RANKS = _Ranks(config, world)
    return _RANKS.model(config, model_path, trainable)


def _ray_gpus() -> bool:
    """This process is in a Ray cluster and has CUDA: its ranks' GPUs go through Ray's accounting."""
    import torch

    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and torch.cuda.is_available()


class _Rank:
    """Ranks 1..N-1: this rank's backends (one per model) in their own process, driven by rank 0."""

    def __init__(self, rank: int, world: int, addr: str, port: int, threads: int) -> None:
        import torch

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port))
        os.environ.setdefault("LOCAL_RANK", "0")  # Ray shows each rank only its own GPU
        torch.set_num_threads(threads)
        self.backends: dict[int, Any] = {}

    def add(self, key: int, config, model_path: str, trainable: bool) -> bool:
        from relax_train.backends.megatron.backend import MegatronBackend

        self.backends[key] = MegatronBackend(config, model_path, trainable)  # the first joins the group
        return True

    def drop(self, key: int) -> None:
        self.backends.pop(key, None)

    def call(self, key: int, method: str, *args, **kwargs):
        out = getattr(self.backends[key], method)(*args, **kwargs)
        return None if method in ("named_weights", "eval_model") else out  # rank 0's copy is the one used

    def set(self, key: int, name: str, value: Any) -> None:
        setattr(self.backends[key], name, value)


_COLLECTIVE = (
    "compute_log_probs",
    "train_step",
    "named_weights",
    "load_weights",
    "save_checkpoint",
    "load_checkpoint",
    "eval_model",
    "export_hf",
    "offload",
    "onload",
)


class _Ranks:
    """The processes of a rank group: this one (rank 0) and ranks 1..N-1 as Ray actors it owns (they die
    with it, so a restarted role starts a fresh group)."""

    def __init__(self, config: RelaxConfig, world: int) -> None:
        import ray
        import torch

        if not ray.is_initialized():
            raise ValueError(
                f"--train-backend megatron with {world} ranks runs ranks 1..{world - 1} as Ray actors, and "
                "no Ray cluster is running here (the controller starts one; call ray.init() first when "
                "building the backend yourself)"
            )
        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        self._pg, gpu0, options = rank_placement(
            world,
            config.train.tensor_model_parallel_size,
            torch.cuda.is_available(),
            config.train.actor_num_gpus_per_node,
        )
        if gpu0 is not None:
            os.environ["LOCAL_RANK"] = str(_device_index(gpu0))
        rank_actor = ray.remote(_Rank)
        # (Any: ray types a handle as `ActorHandle[T] | type[T]`, whose methods have no `.remote` for mypy)
        self._others: list[Any] = [
            rank_actor.options(**opts).remote(r, world, addr, port, torch.get_num_threads())
            for r, opts in enumerate(options, start=1)
        ]
        os.environ.update(RANK="0", WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port))
        os.environ.setdefault("LOCAL_RANK", "0")
        self._keys = 0
        self._locals: dict[int, Any] = {}

    def model(self, config: RelaxConfig, model_path: str, trainable: bool) -> MegatronRankGroup:
        """A backend on every rank (the first one forms the process group)."""
        import ray

        from relax_train.backends.megatron.backend import MegatronBackend

        key, self._keys = self._keys, self._keys + 1
        refs = [r.add.remote(key, config, model_path, trainable) for r in self._others]
        self._locals[key] = MegatronBackend(config, model_path, trainable)
        ray.get(refs)
        return MegatronRankGroup(self, key)

    def local(self, key: int) -> Any:
        """This process's (rank 0's) backend of model ``key``."""
        return self._locals[key]

    def set_on_others(self, key: int, name: str, value: Any) -> None:
        """Set attribute ``name`` of model ``key``'s backend on ranks 1..N-1."""
        import ray

        ray.get([r.set.remote(key, name, value) for r in self._others])

    def drop(self, key: int) -> None:
        """Drop model ``key`` on every rank."""
        import ray

        self._locals.pop(key, None)
        ray.get([r.drop.remote(key) for r in self._others])

    def all(self, key: int, method: str, *args, **kwargs):
        import ray

        refs = [r.call.remote(key, method, *args, **kwargs) for r in self._others]
        out = getattr(self._locals[key], method)(*args, **kwargs)
        ray.get(refs)
        return out

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the process group, so this process can lead another run."""
        import ray

        global _RANKS
        for r in self._others:
            ray.kill(r)
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        if dist_initialized():
            import torch.distributed as dist

            dist.destroy_process_group()
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        from relax_core.net import unpin_gloo_interface

        unpin_gloo_interface()
        self._locals.clear()
        if _RANKS is self:
            _RANKS = None


def rank_placement(
    world: int, tp: int, cuda: bool, per_node: int | None = None
) -> tuple[Any, str | None, list[dict[str, Any]]]:
    """(placement group, rank 0's Ray GPU id, Ray options of ranks 1..world-1). With CUDA: one GPU per
    rank, rank 0's included, so Ray hands no other actor the GPU rank 0 uses; ranks in
    :func:`place_ranks`'s order. Without: CPU processes, ``per_node`` ranks (--actor-num-gpus-per-node)
    per node (:func:`cpu_rank_nodes`)."""
    if not cuda:
        return None, None, cpu_rank_nodes(world, per_node or world)
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = ray.util.placement_group([{"GPU": 1}] * world, strategy="PACK")
    try:
        slots = place_ranks(pg, world, tp)
    except BaseException:
        ray.util.remove_placement_group(pg)
        raise
    options = [
        {"num_gpus": 1, "num_cpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, s.bundle)}
        for s in slots[1:]
    ]
    return pg, slots[0].gpu_id, options


def cpu_rank_nodes(world: int, per_node: int) -> list[dict[str, Any]]:
    """Ray options of CPU ranks 1..world-1, ``per_node`` ranks per node as --actor-num-nodes asks: this
    process's node first, then the other alive nodes by address, round again when the cluster has fewer
    (one node: every rank here, as CI's single-machine runs). Why pinned: without GPUs Ray would put them
    anywhere, and a run of several nodes on CPU (CI's namespace nodes) is how the cross-node path of the
    ranks' gloo group is exercised."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    others = sorted(
        (n["NodeManagerAddress"], n["NodeID"]) for n in ray.nodes() if n["Alive"] and n["NodeID"] != here
    )
    nodes = [here, *(node for _, node in others)]
    return [
        {
            "num_gpus": 0,
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(
                nodes[(r // per_node) % len(nodes)], soft=False
            ),
        }
        for r in range(1, world)
    ]


@dataclass(frozen=True)
class Slot:
    """Where one bundle of the rank group's placement group landed."""

    bundle: int
    node_id: str
    gpu_id: str


def place_ranks(pg: Any, world: int, tp: int = 1, timeout_s: float = 600.0) -> list[Slot]:
    """The bundles of ``pg`` (one GPU each) in rank order: this process's node first, then node by node,
    by GPU id within a node.

    Why: Ray numbers a placement group's bundles in the order they were asked for, not by where they
    landed, and across nodes PACK may put bundle 0 on another node. Rank 0 is this process (it drives the
    group), so its GPU must be a bundle on this node; and megatron builds its groups from consecutive
    ranks (tensor-parallel first), so ranks grouped by node keep each TP group on one node's NVLink when
    the node's GPUs are a multiple of TP."""
    import ray

    from relax_core.placement import probe_bundles

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        gpus = ray.cluster_resources().get("GPU", 0)
        raise RuntimeError(
            f"the megatron trainer's {world} ranks need one GPU each and the Ray cluster could not give them "
            f"in {timeout_s:.0f} s (it has {gpus:g} GPUs, some maybe held by other actors): lower "
            "--actor-num-nodes × --actor-num-gpus-per-node, or add nodes to the cluster"
        )
    slots = [Slot(b, node, gpu) for b, (node, gpu) in enumerate(probe_bundles(pg, world))]
    return order_slots(slots, ray.get_runtime_context().get_node_id(), tp)


def order_slots(slots: list[Slot], here: str, tp: int = 1) -> list[Slot]:
    """:func:`place_ranks`'s order, from the probed bundles; refuses a group with no GPU on ``here``."""

    def gpu_key(g: str):
        return (0, int(g), "") if g.isdigit() else (1, 0, g)

    ordered = sorted(slots, key=lambda s: (s.node_id != here, s.node_id, gpu_key(s.gpu_id)))
    if not ordered or ordered[0].node_id != here:
        raise RuntimeError(
            f"rank 0 of the megatron trainer is this process (node {here}), but none of the {len(slots)} GPUs "
            "Ray reserved for the ranks is on this node: start `relax train` on a node with GPUs (the Ray "
            "head node of the recipe's launch), or give this node's GPUs to Ray (`ray start --num-gpus N`)"
        )
    split = [r for r in range(0, len(ordered), tp) if len({s.node_id for s in ordered[r : r + tp]}) > 1]
    if split:
        logger.warning(
            "tensor-parallel groups starting at ranks %s span two nodes (TP %d; GPUs per node: %s): every "
            "layer's all-reduce then crosses the network; make each node's GPUs a multiple of TP",
            split,
            tp,
            {n: sum(s.node_id == n for s in ordered) for n in dict.fromkeys(s.node_id for s in ordered)},
        )
    return ordered


def _device_index(gpu_id: str) -> int:
    """Ray's GPU id as this process's CUDA device index (CUDA_VISIBLE_DEVICES may renumber them)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible.index(gpu_id) if gpu_id in visible else int(gpu_id)


def dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


class MegatronRankGroup:
    """One model on every rank of a :class:`_Ranks`; same protocol as the backends: the collective
    methods run on every rank in lockstep and the role sees rank 0's answer."""

    def __init__(self, ranks: _Ranks, key: int) -> None:
        object.__setattr__(self, "_ranks", ranks)
        object.__setattr__(self, "_key", key)

    @property
    def _local(self):
        return self._ranks.local(self._key)

    def __getattr__(self, name: str):
        if name in _COLLECTIVE:
            return lambda *args, **kwargs: self._ranks.all(self._key, name, *args, **kwargs)
        return getattr(self._local, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._local, name, value)  # e.g. the teacher role turns routing replay off
        if name == "before_update":  # the trainer's fence: only rank 0's weights are sent from a thread
            return  # (the other ranks' shards were gathered before the broadcast started)
        self._ranks.set_on_others(self._key, name, value)

    def close(self) -> None:
        """The first model built (the trainer) owns the ranks: closing it ends the group; closing
        another model drops it on every rank."""
        if self._key == 0:
            self._ranks.close()
            return
        self._ranks.drop(self._key)
