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

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from _tiny import QUIET, TINY_OPTIM, TINY_STEP

from relax_testing import netns

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "deploy" / "slurm" / "relax.sbatch"
RAYJOB = ROOT / "deploy" / "kuberay" / "rayjob.yaml"
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
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


def _slurm_conf(tmp: Path, n: int) -> Path:
    addrs = ADDRS[:n]
    nodes = "\n".join(f"NodeName={PREFIX}{k} NodeAddr={a} CPUs=2 State=UNKNOWN" for k, a in enumerate(addrs))
    for d in ["state", *(f"spool/{PREFIX}{k}" for k in range(n))]:
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


@contextlib.contextmanager
def _real_slurm(tmp: Path, env: dict[str, str], n: int) -> Iterator[netns.NetnsCluster]:
    """A real Slurm of ``n`` namespace nodes (munged, slurmctld, one slurmd per node), registered and idle;
    ``env`` gets its SLURM_CONF. The daemons are killed on the way out."""
    key = tmp / "munge.key"
    key.write_bytes(os.urandom(128))
    key.chmod(0o600)
    env["SLURM_CONF"] = str(_slurm_conf(tmp, n))
    daemons: list[subprocess.Popen] = []
    start = lambda argv: daemons.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL))  # noqa: E731
    try:
        with netns.NetnsCluster(n, prefix=PREFIX, bridge=BRIDGE, subnet=SUBNET, start_ray=False) as cluster:
            munge = [f"--socket={tmp}/munge.sock", f"--key-file={key}", f"--pid-file={tmp}/m.pid"]
            start(["munged", "-F", "--force", *munge, f"--seed-file={tmp}/m.seed", "--log-file=/dev/null"])
            time.sleep(0.5)
            start(["slurmctld", "-D", "-i", "-f", env["SLURM_CONF"]])
            for node in cluster.nodes:
                slurmd = ["slurmd", "-D", "-N", node.name, "-f", env["SLURM_CONF"]]
                # (nsenter, not `ip netns exec`: the fresh /sys that one mounts lacks the CPU topology
                # slurmd's hwloc reads here; unshare -m for the worker's own Ray dir)
                private = ["unshare", "-m", "--propagation", "slave", *_private_ray_dir(slurmd)]
                start(["nsenter", f"--net=/var/run/netns/{node.name}", *(private if node.index else slurmd)])
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                states = subprocess.run(
                    ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=env
                )
                if states.stdout.split() == ["idle"] * n:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"the {n} slurmd did not register: {states.stdout}{states.stderr}")
            yield cluster
    finally:
        for daemon in daemons:
            daemon.kill()
            daemon.wait()


def _sbatch(tmp: Path, env: dict[str, str], n: int, args: list[str], timeout: float) -> str:
    """``sbatch -W`` of the script on ``n`` nodes with ``args``; its whole output, asserting it succeeded."""
    job = subprocess.run(
        # (no GPUs in this Slurm: the script's `#SBATCH --gpus-per-node=8` is overridden)
        ["sbatch", "-W", f"--nodes={n}", "--gpus-per-node=0", f"--output={tmp}/job.out", str(SBATCH), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    log = (tmp / "job.out").read_text() if (tmp / "job.out").exists() else ""
    log = f"{job.stdout}{job.stderr}{log}"
    assert job.returncode == 0, log
    return log


@pytest.mark.integration
@needs_netns
@pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
def test_sbatch_script_under_a_real_slurm_of_three_namespace_nodes(tmp_path):
    env = _job_env(tmp_path, {})
    with _real_slurm(tmp_path, env, 3) as cluster:
        log = _sbatch(tmp_path, env, 3, USER_ARGS, timeout=150)
        _assert_ran(tmp_path, cluster, log)


@pytest.mark.integration
@needs_netns
@pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
def test_sbatch_script_runs_relax_train_with_a_yaml_config_to_completion(tmp_path, tiny_run_inputs):
    """The real ``relax train CONFIG.yaml`` (not a recorder) under a real one-node Slurm: the script puts
    ``--ray-address`` before the user's arguments, and the YAML after it must be read as the config (it
    was refused: `relax: unexpected argument '…yaml'`, the job FAILED with exit 2)."""
    config = tmp_path / "run.yaml"
    out = tmp_path / "run"
    flags = {**TINY_STEP, **TINY_OPTIM, **QUIET, "num_rollout": 2}
    config.write_text(
        yaml.safe_dump(
            {
                "hf_checkpoint": tiny_run_inputs.model_path,
                "prompt_data": tiny_run_inputs.prompt_path,
                "output_dir": str(out),
                "colocate": True,
                **flags,
            }
        )
    )
    env = _job_env(tmp_path, {})
    del env["RELAX_TRAIN_CMD"]  # the real `relax train`, from the venv on PATH
    with _real_slurm(tmp_path, env, 1) as cluster:
        log = _sbatch(tmp_path, env, 1, [str(config)], timeout=300)
        logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert len([r for r in logged if "train/loss" in r]) == 2, log
        assert "1 nodes joined" in log and "Ray stopped on 1 nodes" in log, log
        assert _ray_processes(cluster) == [], log


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


@pytest.mark.integration
def test_rayjob_entrypoint_as_written_parses_through_to_the_inputs_check(tmp_path):
    """The RayJob's entrypoint string run by bash as the head runs it, from a directory without the repository
    (the recipe path resolves to the one shipped in the relax-app package): the command line is read whole
    (the YAML after --ray-address was refused) and the run starts, stopping at its inputs check on the
    first thing this machine lacks, the checkpoint under /data (exit 2, one line naming it)."""
    entrypoint = yaml.safe_load_all(RAYJOB.read_text())
    spec = next(d for d in entrypoint if d["kind"] == "RayJob")["spec"]
    env = {
        **os.environ,
        "RAY_ADDRESS": "127.0.0.1:6379",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    out = subprocess.run(
        ["bash", "-c", spec["entrypoint"]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "relax: --hf-checkpoint /data/models/Qwen3-Omni-30B-A3B-Thinker: no model there (config.json missing); "
        "give an HF model directory"
    )


@pytest.mark.integration
@pytest.mark.shared_ray
def test_rayjob_entrypoint_as_written_starts_a_run_on_the_cluster_it_is_given(tmp_path, tiny_run_inputs):
    """The entrypoint string, run by bash as written with only its paths pointed at what this machine has
    (the recipe at a tiny CPU config, /data at the tiny model and task) and RAY_ADDRESS at a running
    cluster: the run joins that cluster and trains to its end. (Fully async: on a CPU a colocate run is one
    process and uses no Ray; the recipe's colocate on GPUs places its ranks through the cluster.)"""
    import ray

    spec = next(d for d in yaml.safe_load_all(RAYJOB.read_text()) if d["kind"] == "RayJob")["spec"]
    config = tmp_path / "cpu.yaml"
    config.write_text(
        yaml.safe_dump({"fully_async": True, "num_rollout": 2, **TINY_STEP, **TINY_OPTIM, **QUIET})
    )
    here = {
        "apps/relax/recipes/qwen3_omni_30b_avqa.yaml": str(config),
        "/data/models/Qwen3-Omni-30B-A3B-Thinker": tiny_run_inputs.model_path,
        "/data/models/Qwen3-Omni-30B-A3B-Instruct": tiny_run_inputs.model_path,
        "/data/AVQA-R1-6K/AVQA_R1/train/train.converted.jsonl": tiny_run_inputs.prompt_path,
        "/data/runs/qwen3_omni_30b_avqa": str(tmp_path / "run"),
    }
    entrypoint = spec["entrypoint"]
    for theirs, ours in here.items():
        assert theirs in entrypoint
        entrypoint = entrypoint.replace(theirs, ours)
    env = {
        **os.environ,
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    jobs = len(ray._private.state.jobs())  # (the GCS's job table: a driver that joins adds one)
    out = subprocess.run(
        ["bash", "-c", entrypoint], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in logged if "train/loss" in r]) == 2
    assert len(ray._private.state.jobs()) == jobs + 1  # it ran on the cluster given, not one of its own


def test_the_dockerfile_copies_what_exists_and_the_rayjob_names_its_image():
    text = DOCKERFILE.read_text()
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from=" not in line:
            *sources, _ = line.split()[1:]
            assert all((ROOT / src).exists() for src in sources), line
    images = {c["image"] for c in _containers(RAYJOB)}
    assert images == {"REPLACE/relax:latest"} and "deploy/docker/Dockerfile" in RAYJOB.read_text()
    assert "-t <your-registry>/relax:latest" in text


def _containers(path: Path) -> list[dict]:
    """Every container of a manifest's pod templates."""
    found: list[dict] = []

    def walk(node):
        if isinstance(node, dict):
            found.extend(node.get("containers", []))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for doc in yaml.safe_load_all(path.read_text()):
        walk(doc)
    return found


@pytest.mark.integration
def test_the_dockerfiles_install_step_resolves(tmp_path):
    """The image's install step, dry-run here against the package index (no Docker here): the workspace's
    wheels and their GPU extras resolve together (SGLang and megatron-core on Linux)."""
    subprocess.run(
        ["uv", "build", "--all-packages", "--wheel", "--out-dir", str(tmp_path / "wheels"), "-q"],
        cwd=ROOT,
        check=True,
    )
    text = DOCKERFILE.read_text().replace("\\\n", " ")  # (continued lines joined)
    (run,) = [line[4:] for line in text.splitlines() if line.startswith("RUN uv venv")]
    install = run.split("&& ", 1)[1].replace("/wheels", str(tmp_path / "wheels"))
    subprocess.run(["uv", "venv", "-q", "--python", "3.11", str(tmp_path / "venv")], check=True)
    env = {**os.environ, "VIRTUAL_ENV": str(tmp_path / "venv")}
    out = subprocess.run(
        ["bash", "-c", f"rm -f {tmp_path}/wheels/relax_testing-*.whl && {install} --dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0 and any(w in out.stderr for w in ("Failed to fetch", "dns error", "Connection")):
        pytest.skip(f"no package index reachable: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr
    for want in ("relax-app==", "relax-rollout==", "sglang==", "megatron-core==", "ray=="):
        assert f" + {want}" in out.stderr, out.stderr
    assert "relax-testing" not in out.stderr
