"""Several Ray nodes: a run joins a running cluster, a megatron trainer's ranks follow the nodes. (Where a
fully-async run's roles and SGLang's engines go, across nodes with addresses of their own:
``tests/test_netns_runs.py``.)

The cluster here is two Ray nodes on this machine (``ray.cluster_utils.Cluster``: a raylet each) with
logical GPUs: Ray schedules and numbers them as on a real cluster, though no process here can use CUDA.
That is what these tests check: where Ray puts things, not the GPUs themselves.
"""

from __future__ import annotations

import logging
import os

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    """Two nodes of 2 logical GPUs each; yields the cluster's address (no driver connected)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2})
    cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.wait_for_nodes()
    yield cluster.address
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def connected(two_nodes):
    ray.init(address=two_nodes)
    yield
    ray.shutdown()


def _config(**run):
    from relax_core.config import RelaxConfig

    return RelaxConfig.model_validate({"run": run})


def test_a_run_joins_the_cluster_that_ray_address_names(two_nodes, monkeypatch):
    """``RAY_ADDRESS=<head> relax train`` (the multi-node recipe's launch) connects to the running
    cluster instead of starting one (Ray refuses ``num_cpus`` there), and leaving the run only
    disconnects: the cluster keeps running."""
    from relax_core.run import start_ray as _start_ray

    monkeypatch.setenv("RAY_ADDRESS", two_nodes)
    assert _start_ray(_config()) is True
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
        assert ray.cluster_resources()["GPU"] == 4
    finally:
        ray.shutdown()
    ray.init(address=two_nodes)  # still there
    ray.shutdown()

    with pytest.raises(ValueError, match="--num-cpus .*RAY_ADDRESS"):
        _start_ray(_config(num_cpus=2))
    assert not ray.is_initialized()

    monkeypatch.delenv("RAY_ADDRESS")  # --ray-address says the same (the launchers in deploy/ pass it)
    assert _start_ray(_config(ray_address=two_nodes)) is True
    try:
        assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    finally:
        ray.shutdown()


def _node_of_actor() -> type:
    @ray.remote
    class Where:
        def node(self) -> tuple[str, list]:
            return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    return Where


def test_megatron_ranks_follow_the_nodes(connected, caplog):
    """Four ranks on two nodes of two GPUs (TP 2): rank 0 (this process) gets a GPU of this node, the
    ranks go node by node so each TP pair stays on one node, and every rank's actor lands on the GPU
    its bundle was probed on: four distinct GPUs."""
    from relax_train.backends.megatron.group import rank_placement

    here = ray.get_runtime_context().get_node_id()
    with caplog.at_level(logging.WARNING, logger="relax_train.backends.megatron.group"):
        pg, gpu0, options = rank_placement(4, tp=2, cuda=True)
    try:
        assert not [r for r in caplog.records if "span two nodes" in r.getMessage()]
        where = _node_of_actor()
        actors = [where.options(**o).remote() for o in options]
        placed = [(here, [gpu0]), *ray.get([a.node.remote() for a in actors])]
        nodes = [n for n, _ in placed]
        assert nodes[0] == here and nodes[1] == here  # rank 0's TP group: both on this node
        assert nodes[2] == nodes[3] != here  # the other pair on the other node
        assert len({(n, g[0]) for n, g in placed}) == 4  # no GPU given twice (rank 0's is reserved too)
        for a in actors:
            ray.kill(a)
    finally:
        ray.util.remove_placement_group(pg)

    with caplog.at_level(logging.WARNING, logger="relax_train.backends.megatron.group"):
        pg, _, _ = rank_placement(4, tp=4, cuda=True)  # a TP group of 4 cannot fit on a node of 2
    ray.util.remove_placement_group(pg)
    assert [r for r in caplog.records if "span two nodes" in r.getMessage()]


def test_rank_order_from_probed_bundles():
    """Bundles come back in Ray's order, wherever they landed; ranks are this node's GPUs first (by GPU
    id, 10 after 9), then node by node. No GPU on this node is refused, naming the fix."""
    from relax_train.backends.megatron.group import Slot, order_slots

    probed = [Slot(0, "b", "1"), Slot(1, "a", "10"), Slot(2, "b", "0"), Slot(3, "a", "9"), Slot(4, "c", "0")]
    ordered = order_slots(probed, here="b", tp=2)
    assert [(s.node_id, s.gpu_id) for s in ordered] == [
        ("b", "0"),
        ("b", "1"),
        ("a", "9"),
        ("a", "10"),
        ("c", "0"),
    ]
    assert [s.bundle for s in ordered] == [2, 0, 3, 1, 4]
    with pytest.raises(
        RuntimeError, match="none of the 5 GPUs .* is on this node: start `relax train` on a node"
    ):
        order_slots(probed, here="head-without-gpus")


def test_the_roles_of_a_cluster_the_run_starts_are_not_niced():
    """Ray's default worker niceness (15) let any normal-priority process starve the roles of a fully-async
    run (no step in 9 minutes beside one busy process per core, #51)."""
    from relax_core.run import start_ray as _start_ray

    assert _start_ray(_config(num_cpus=1)) is True
    try:
        niceness = ray.get(ray.remote(lambda: os.nice(0)).remote(), timeout=120)
        assert niceness == os.nice(0)  # (the driver's own)
    finally:
        ray.shutdown()
