"""Where the roles of a fully-async run go: which GPUs each holds (disjoint sets, every one reserved through
Ray), and on a cluster of several nodes which node each runs on (:class:`NodePlacement`, #40).

Why: in fully async every role has devices of its own. The megatron roles (trainer, ActorFwd, Reference,
Teacher) reserve their ranks' GPUs as Ray placement groups; SGLang's engines are processes the rollout
role starts itself, so before this module they took GPUs ``0..N-1`` of the machine with Ray none the
wiser, and Ray handed the same ids to the trainer's placement group (two processes per GPU, out of memory
at the first batch). Now the rollout reserves its engines' GPUs through Ray too (:func:`reserve_gpus`), so
Ray's own accounting keeps every role's set apart, and the run checks before it starts anything that the
cluster has the GPUs all the roles together need (:func:`gpu_demand`), instead of waiting minutes for a
placement group that can never be met.

Each megatron role holds a whole replica in the trainer's parallel layout (``--actor-num-nodes`` ×
``--actor-num-gpus-per-node`` GPUs): ActorFwd computes log-probs with the trainer's latest weights and
Reference with the initial ones, each on its own devices so that none waits for another.
"""

from __future__ import annotations

from typing import Any

from relax_core.config import RelaxConfig
from relax_core.net import alive_nodes
from relax_core.optional import import_ray
from relax_core.roles import RolePlan


def gpu_demand(cfg: RelaxConfig, plan: RolePlan | None = None) -> dict[str, int]:
    """GPUs each role of a fully-async run reserves (roles that use none are left out): the rollout its
    SGLang engines', every other role loading a model a replica of the megatron trainer's layout. Colocate
    mode time-shares one set between the roles, so it has no separate demand: ``{}``. ``plan``: the run's
    roles (default: from the installed registry)."""
    if cfg.run.mode != "fully_async":
        return {}
    plan = plan if plan is not None else RolePlan.from_config(cfg)
    t, r = cfg.train, cfg.rollout
    out: dict[str, int] = {}
    if r.rollout_backend == "sglang":
        out[plan.rollout] = r.rollout_num_gpus
    if t.train_backend == "megatron" and t.actor_num_gpus_per_node > 0:
        world = t.actor_num_nodes * t.actor_num_gpus_per_node
        for name in [plan.trainer, *plan.loops]:
            if plan.roles[name].model is not None:
                out[name] = world
    return out


def check_gpu_demand(demand: dict[str, int], available: float) -> None:
    """Refuse, naming each role's share, a run whose roles need more GPUs than the cluster has."""
    need = sum(demand.values())
    if need > available:
        shares = ", ".join(f"{role} {n}" for role, n in demand.items())
        raise ValueError(
            f"--fully-async gives every role GPUs of its own: {shares} = {need} GPUs, and the Ray cluster has "
            f"{available:g}. Lower --rollout-num-gpus or --actor-num-gpus-per-node (ActorFwd, Reference and "
            "Teacher each hold a replica of the trainer's layout; --no-use-actor-fwd drops ActorFwd), or add "
            "nodes to the cluster"
        )


def probe_bundles(pg: Any, n: int) -> list[tuple[str, str]]:
    """(node id, Ray's GPU id) of each of the first ``n`` bundles of ``pg`` (one GPU each), in bundle
    order: a tiny task runs in each bundle and reports where it landed."""
    ray = import_ray("placing roles on GPUs")
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe = ray.remote(num_gpus=1, num_cpus=0)(_where)
    refs = [
        probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, b)).remote() for b in range(n)
    ]
    return [tuple(x) for x in ray.get(refs)]


def _where() -> tuple[str, str]:
    import ray

    return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])


def reserve_gpus(n: int, role: str, timeout_s: float = 600.0) -> tuple[Any, list[str]]:
    """A placement group of ``n`` GPUs on this node (``STRICT_PACK``) for processes ``role`` starts
    itself, and their Ray GPU ids in numeric order (what the processes' ``CUDA_VISIBLE_DEVICES`` name).
    The group holds them until it is removed (``ray.util.remove_placement_group``) or this process
    ends."""
    ray = import_ray(f"the {role} role's GPU reservation")

    pg = ray.util.placement_group([{"GPU": 1}] * n, strategy="STRICT_PACK")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        free = ray.available_resources().get("GPU", 0)
        raise RuntimeError(
            f"the {role} role needs {n} GPUs on its node and Ray could not reserve them in {timeout_s:.0f} s "
            f"({free:g} GPUs free in the cluster now; other roles hold theirs): lower its GPUs or add them"
        )
    ids = [gpu for _, gpu in probe_bundles(pg, n)]
    return pg, sorted(ids, key=lambda g: (0, int(g), "") if g.isdigit() else (1, 0, g))


class NodePlacement:
    """Which node each actor of a fully-async run goes on (#40): the node ``--role-nodes`` names for the
    role, else the driver's. The bus always stays on the driver's node: its payloads live in the storage
    units' object store, so a lost node takes no sample with it.

    A role that fails on a node other than the driver's is restarted on the driver's node, and so is
    every role named for that node afterwards: the node may be dead, or cut off while Ray still counts it
    alive (an actor asked of it would wait for its network). The driver's node is the one the run cannot
    lose (it holds the driver and the bus)."""

    def __init__(self, ray: Any, role_nodes: dict[str, str], roles: list[str]) -> None:
        unknown = sorted(set(role_nodes) - set(roles))
        if unknown:
            raise ValueError(
                f"--role-nodes names {unknown}, not roles of this run; its roles are {sorted(roles)}"
            )
        self.ray, self.role_nodes = ray, dict(role_nodes)
        self.driver_node = ray.get_runtime_context().get_node_id()
        by_id = {node: address for address, node in alive_nodes(ray).items()}
        self.driver_address = by_id.get(self.driver_node, "")
        self.lost: set[str] = set()
        """Addresses of nodes a role failed on: nothing is placed there again in this run."""
        self.placed: dict[str, str] = {}
        """Role → the address of the node its current actor was placed on."""

    def check(self) -> None:
        """Every node --role-nodes names is in the cluster, alive (or known lost: a global restart places
        its roles on the driver's node): refused otherwise, naming the ones there are."""
        alive = set(alive_nodes(self.ray))
        missing = sorted({a for a in self.role_nodes.values() if a not in alive and a not in self.lost})
        if missing:
            raise ValueError(
                f"--role-nodes names nodes {missing} that are not alive in this Ray cluster; its nodes are "
                f"{sorted(alive)} (the addresses `ray start --node-ip-address` gave them)"
            )

    def strategy(self, role: str) -> Any:
        """The scheduling strategy of ``role``'s next actor (records where it goes)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        by_address = alive_nodes(self.ray)
        address = self.role_nodes.get(role)
        if address is None or address in self.lost or address not in by_address:
            node, address = self.driver_node, self.driver_address
        else:
            node = by_address[address]
        self.placed[role] = address
        return NodeAffinitySchedulingStrategy(node, soft=False)

    def probe(self, timeout_s: float = 30.0) -> None:
        """Before a global restart: every node still named gets a task; one that does not answer in
        ``timeout_s`` (dead, or cut off while Ray still counts it alive) is treated as lost."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        by_address = alive_nodes(self.ray)
        named = {a for a in self.role_nodes.values() if a not in self.lost}
        self.lost |= {a for a in named if a not in by_address}
        probes = {}
        for address in named - self.lost:
            where = NodeAffinitySchedulingStrategy(by_address[address], soft=False)
            probes[self.ray.remote(num_cpus=0)(_here).options(scheduling_strategy=where).remote()] = address
        if probes:
            ready, _ = self.ray.wait(list(probes), num_returns=len(probes), timeout=timeout_s)
            self.lost |= {a for ref, a in probes.items() if ref not in ready}

    def failed(self, role: str) -> None:
        """``role`` failed: its node, unless it is the driver's, takes no actor of this run again."""
        address = self.placed.get(role)
        if address and address != self.driver_address:
            self.lost.add(address)


def _here() -> bool:
    return True
