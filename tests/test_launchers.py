"""The multi-node launchers (#40): ``deploy/slurm/relax.sbatch`` run on three network-namespace nodes (each its
own address, as ``relax_testing.netns`` makes them), and ``deploy/kuberay/rayjob.yaml``'s structure.

The sbatch script runs twice where it can: under a real Slurm (``slurmctld`` in the root namespace, one
``slurmd -N <node>`` inside each namespace, ``munged`` on a private socket; runs where Debian's slurm-wlm is
installed, else skips), and with the variables a real allocation sets plus an ``srun`` that runs its command
inside the named node's namespace (runs wherever namespaces can be made: CI). What the second does not run
of a real Slurm: the controller's allocation, the step's resource binding (CPUs, GPUs, cgroups), the
propagation of the environment and signals by slurmd; the first runs all of those but GPUs and cgroups
(proctrack/linuxproc, no GRES). Instead of ``relax train`` both run a recorder (``RELAX_TRAIN_CMD``) that
joins the cluster at the --ray-address it is given and writes down its arguments and the nodes alive.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from relax_testing import netns

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "deploy" / "slurm" / "relax.sbatch"
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
PREFIX, BRIDGE, SUBNET = "slurmn", "slurmbr0", "10.78.0"  # (the lead's tests use relaxn / relaxbr0 / 10.77.0)
ADDRS = [f"{SUBNET}.{k}" for k in (1, 2, 3)]
USER_ARGS = ["apps/relax/recipes/qwen3_4b_dapo.yaml", "--hf-checkpoint", "/models/a b"]  # (a space, kept)

WHY_NOT = netns.available()
needs_netns = pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
SLURM_BINS = ("sbatch", "slurmctld", "slurmd", "munged", "sinfo")
NO_SLURM = next(
    (f"no `{b}` (apt-get install slurm-wlm)" for b in SLURM_BINS if shutil.which(b) is None), None
)

RECORDER = """\
import json, os, sys
import ray
args = sys.argv[1:]
ray.init(address=args[args.index("--ray-address") + 1], logging_level="ERROR", log_to_driver=False)
alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
out = {"argv": args, "alive": alive, "auth_mode": os.environ.get("RAY_AUTH_MODE")}
open(os.environ["RECORD_TO"], "w").write(json.dumps(out))
"""

SRUN = """\
#!/bin/sh
# srun stand-in: `srun [options] --nodelist=NODE CMD...` runs CMD in NODE's namespace (options else ignored).
while [ $# -gt 0 ]; do
    case "$1" in --nodelist=*) node="${1#--nodelist=}"; shift;; -*) shift;; *) break;; esac
done
mkdir -p "$RELAX_RAY_TEMP_DIR"  # (a node's own Ray temp dir, as on a real node: see _private_ray_dir)
exec ip netns exec "$node" sh -c 'mount -t tmpfs tmpfs "$RELAX_RAY_TEMP_DIR" && exec "$@"' srun "$@"
"""

SCONTROL = """\
#!/bin/sh
# scontrol stand-in: only `scontrol show hostnames slurmn[0-2]`.
python3 -c "import re,sys; p,a,b=re.fullmatch(r'(.*)\\[(\\d+)-(\\d+)\\]',sys.argv[1]).groups(); \
print('\\n'.join(p+str(k) for k in range(int(a),int(b)+1)))" "$3"
"""


def _nodes() -> netns.NetnsCluster:
    """The namespaces and their bridge only: Ray is the script's to start."""
    return netns.NetnsCluster(3, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET, start_ray=False)


def _private_ray_dir(argv: list[str]) -> list[str]:
    """``argv`` with a tmpfs of its own on the Ray temp dir. Why: the nodes share this machine's /tmp, and Ray
    names a node's sockets there by the first free name, so two workers starting at once (as the script
    starts them) would pick the same; real nodes each have their own /tmp."""
    d = f"/tmp/{PREFIX}_ray"
    return ["sh", "-c", f'mkdir -p {d} && mount -t tmpfs tmpfs {d} && exec "$@"', "node", *argv]


def _ray_processes(cluster: netns.NetnsCluster) -> list[str]:
    """The command lines of the Ray processes left in the nodes' namespaces."""
    left = []
    for node in cluster.nodes:
        for pid in node.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "ray" in cmd and "slurmd" not in cmd:
                left.append(f"{node.name}: {cmd[:120]}")
    return left


def _job_env(tmp: Path, extra: dict[str, str]) -> dict[str, str]:
    (tmp / "recorder.py").write_text(RECORDER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM"))}
    return {
        **env,
        **extra,
        "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
        "HOME": str(tmp / "home"),  # (the script makes the token there, not in root's ~/.ray)
        "RELAX_TRAIN_CMD": f"{sys.executable} {tmp / 'recorder.py'}",
        "RECORD_TO": str(tmp / "record.json"),
        "RELAX_RAY_TEMP_DIR": f"/tmp/{PREFIX}_ray",
        "RELAX_JOIN_TIMEOUT_S": "90",
    }


def _assert_ran(tmp: Path, cluster: netns.NetnsCluster, log: str) -> None:
    record = json.loads((tmp / "record.json").read_text())
    assert record["argv"] == ["--ray-address", f"{ADDRS[0]}:6379", *USER_ARGS], log
    assert record["alive"] == ADDRS, log  # every node joined, each at its own address
    assert record["auth_mode"] == "token"
    assert (tmp / "home" / ".ray" / "auth_token").is_file()  # made by the script, handed to the workers
    assert f"3 nodes joined: {' '.join(ADDRS)}" in log and "Ray stopped on 3 nodes" in log, log
    assert _ray_processes(cluster) == [], log  # Ray stopped everywhere


@pytest.mark.integration
@needs_netns
@pytest.mark.skipif(NO_SLURM is None, reason="a real Slurm runs here: the test under it covers the script")
def test_sbatch_script_with_the_variables_of_an_allocation_and_an_srun_into_namespaces(tmp_path):
    shims = tmp_path / "bin"
    shims.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (shims / name).write_text(text)
        (shims / name).chmod(0o755)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": f"{PREFIX}[0-2]",
        "SLURM_NNODES": "3",
        "SLURM_CPUS_ON_NODE": "1",
        "SLURMD_NODENAME": f"{PREFIX}0",
    }
    env = _job_env(tmp_path, slurm)
    env["PATH"] = f"{shims}:{env['PATH']}"
    with _nodes() as cluster:
        out = subprocess.run(
            cluster.head.exec_argv(["bash", str(SBATCH), *USER_ARGS]),
            capture_output=True,
            text=True,
            env=env,
            timeout=150,
        )
        log = out.stdout + out.stderr
        assert out.returncode == 0, log
        _assert_ran(tmp_path, cluster, log)


def _slurm_conf(tmp: Path) -> Path:
    nodes = "\n".join(f"NodeName={PREFIX}{k} NodeAddr={a} CPUs=2 State=UNKNOWN" for k, a in enumerate(ADDRS))
    for d in ["state", *(f"spool/{PREFIX}{k}" for k in range(len(ADDRS)))]:
        (tmp / d).mkdir(parents=True)
    conf = tmp / "slurm.conf"
    conf.write_text(
        f"""ClusterName={PREFIX}
SlurmctldHost={socket.gethostname()}({SUBNET}.254)
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
AuthInfo=socket={tmp}/munge.sock
CredType=cred/munge
SlurmUser=root
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool/%n
SlurmctldPidFile={tmp}/ctld.pid
SlurmdPidFile={tmp}/slurmd.%n.pid
SlurmctldLogFile={tmp}/ctld.log
SlurmdLogFile={tmp}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
{nodes}
PartitionName=p Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    return conf


@pytest.mark.integration
@needs_netns
@pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
def test_sbatch_script_under_a_real_slurm_of_three_namespace_nodes(tmp_path):
    key = tmp_path / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    conf = _slurm_conf(tmp_path)
    env = _job_env(tmp_path, {"SLURM_CONF": str(conf)})
    daemons: list[subprocess.Popen] = []
    start = lambda argv: daemons.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))  # noqa: E731
    try:
        with _nodes() as cluster:
            munge = [f"--socket={tmp_path}/munge.sock", f"--key-file={key}", f"--pid-file={tmp_path}/m.pid"]
            start(
                ["munged", "-F", "--force", *munge, f"--seed-file={tmp_path}/m.seed", "--log-file=/dev/null"]
            )
            time.sleep(0.5)
            start(["slurmctld", "-D", "-i", "-f", str(conf)])
            for node in cluster.nodes:
                slurmd = ["slurmd", "-D", "-N", node.name, "-f", str(conf)]
                # (nsenter, not `ip netns exec`: the fresh /sys that one mounts lacks the CPU topology
                # slurmd's hwloc reads here; unshare -m for the worker's own Ray dir)
                private = ["unshare", "-m", "--propagation", "slave", *_private_ray_dir(slurmd)]
                start(["nsenter", f"--net=/var/run/netns/{node.name}", *(private if node.index else slurmd)])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = subprocess.run(
                    ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env
                )
                if states.stdout.split() == ["idle"] * 3:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"the three slurmd did not register: {states.stdout}{states.stderr}")
            job = subprocess.run(
                # (no GPUs in this Slurm: the script's `#SBATCH --gpus-per-node=8` is overridden)
                [
                    "sbatch",
                    "-W",
                    "--nodes=3",
                    "--gpus-per-node=0",
                    f"--output={tmp_path}/job.out",
                    str(SBATCH),
                ]
                + USER_ARGS,
                capture_output=True,
                text=True,
                env=env,
                timeout=150,
            )
            log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
            log = f"{job.stdout}{job.stderr}{log}"
            assert job.returncode == 0, log
            _assert_ran(tmp_path, cluster, log)
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def test_rayjob_manifest_runs_relax_train_with_the_omni_recipes_placement_and_the_token():
    """Structure only (not validated against KubeRay's CRD schema nor a Kubernetes API server)."""
    docs = {d["kind"]: d for d in yaml.safe_load_all(RAYJOB.read_text())}
    job, secret = docs["RayJob"], docs["Secret"]
    assert job["apiVersion"] == "ray.io/v1" and secret["apiVersion"] == "v1"
    spec = job["spec"]
    assert 'relax train --ray-address "$RAY_ADDRESS"' in spec["entrypoint"]
    recipe = yaml.safe_load((ROOT / "apps/relax/recipes/qwen3_omni_30b_avqa.yaml").read_text())
    assert "apps/relax/recipes/qwen3_omni_30b_avqa.yaml" in spec["entrypoint"]
    want = recipe["train"]["actor_num_nodes"] * recipe["train"]["actor_num_gpus_per_node"]
    assert want == recipe["rollout"]["rollout_num_gpus"] == 16  # (colocate: the same 16 GPUs)

    def gpus(group: dict) -> int:
        (container,) = group["template"]["spec"]["containers"]
        limit = int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert int(group["rayStartParams"]["num-gpus"]) == limit
        return limit

    cluster = spec["rayClusterSpec"]
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert gpus(head) + sum(w["replicas"] * gpus(w) for w in workers) == want
    assert 1 + sum(w["replicas"] for w in workers) == recipe["train"]["actor_num_nodes"]
    containers = [
        head["template"]["spec"]["containers"][0],
        spec["submitterPodTemplate"]["spec"]["containers"][0],
    ]
    containers += [w["template"]["spec"]["containers"][0] for w in workers]
    for c in containers:  # every Ray process, and the submitter, presents the Secret's token
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        ref = env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
