"""Several Ray nodes with addresses of their own on this one machine (#40, the start of the multi-node tier):
three network namespaces on a bridge, each running the real ``ray start`` (the head, then two workers joined
to the head's address). What ``tests/test_multinode.py``'s one-address cluster cannot show: the nodes are
at 10.77.0.1-3, and a whole node can be killed. Runs where network namespaces can be made (root: CI)."""

from __future__ import annotations

import subprocess

import pytest

from relax_testing import netns

WHY_NOT = netns.available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))


@pytest.mark.integration
def test_three_namespace_nodes_join_one_cluster_at_their_own_addresses():
    with netns.NetnsCluster(3, ray_args={k: ["--num-cpus=1"] for k in range(3)}) as cluster:
        assert cluster.alive_addresses() == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
        assert cluster.nodes[2].kill() > 0  # a whole node's processes (its raylet among them)
        assert not cluster.nodes[2].pids()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert "relaxn" not in out.stdout  # torn down, namespaces and all
