"""Several Ray nodes with addresses of their own on this one machine (#40, the start of the multi-node tier):
three network namespaces on a bridge, each running the real ``ray start`` (the head, then two workers joined
to the head's address). What ``tests/test_multinode.py``'s one-address cluster cannot show: the nodes are
at 10.77.0.1-3, and a whole node can be killed. Runs where network namespaces can be made (root: CI)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relax_testing import netns

pytestmark = pytest.mark.skipif(netns.available() is not None, reason=str(netns.available()))


@pytest.mark.integration
def test_three_namespace_nodes_join_one_cluster_at_their_own_addresses():
    with netns.NetnsCluster(3, ray_args={k: ["--num-cpus=1"] for k in range(3)}) as cluster:
        code = (
            "import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(','.join(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))"
        )
        run = subprocess.run(
            cluster.head.exec_argv([sys.executable, "-c", code]),
            capture_output=True,
            text=True,
            timeout=120,
            env=cluster.env(),
        )
        assert run.stdout.strip().splitlines()[-1] == "10.77.0.1,10.77.0.2,10.77.0.3", run.stderr[-2000:]
        assert cluster.nodes[2].kill() > 0  # a whole node's processes (its raylet among them)
        assert not cluster.nodes[2].pids()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert "relaxn" not in out.stdout  # torn down, namespaces and all
