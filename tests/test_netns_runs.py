"""Runs across three Ray nodes with addresses of their own (#40): each node a Linux network namespace on a
bridge (10.77.0.1-3), Ray started in each with the real ``ray start`` (the head, then two workers joined to
its address), the run's driver started on the head with ``--ray-address``. What the one-address cluster of
``tests/test_multinode.py`` cannot show: a weight group, a store or a bus reached through 127.0.0.1 breaks
here, and a whole node can be killed or cut off the network.

- A fully-async run with its roles on the three nodes (``--role-nodes``: the rollout on one, the trainer on
  another, the forward roles with the bus on the head) trains what the same run on one node trains and
  evaluates the same, every role on the node it was given.
- The trainer's node killed mid-run (its raylet and every process in its namespace), and, in another run,
  the rollout's node cut off the network for twice the heartbeat time-out: the role is restarted on the
  driver's node and the run trains exactly the uninterrupted run's prompts; the node then joins the
  cluster again.
- A colocate run whose megatron trainer has a rank on each of two nodes (``--actor-num-nodes 2``, gloo
  across the namespaces).
- The elastic API across nodes: bound to the rollout's node address behind the token, it launches an engine
  on the node a scale-out names, joins an engine server started on another node, and scales in mid-run.
- SGLang-protocol engines on two nodes taking a version on the weight group across them: the real SGLang on
  CPU in a node of its own (CI), or our engine server standing in (where the real one may not run).

Needs root and ``ip`` (CI runs as root); skipped elsewhere with the reason.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_core.weight_audit import read_audit
from relax_testing import netns
from relax_testing.http_calls import call, scrape, series
from relax_testing.netns_driver import after_step, drive, last_step, stop

WHY_NOT = netns.available()
pytestmark = [pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT)), pytest.mark.integration]

STEPS = 3
HEARTBEAT_TIMEOUT_S = 6.0
PLACEMENT = {"rollout": "10.77.0.2", "actor": "10.77.0.3", "reference": "10.77.0.1", "actor_fwd": "10.77.0.1"}
"""The rollout on one node, the trainer on another, the forward roles (and the bus) on the head."""


@pytest.fixture(scope="module")
def cluster():
    gpus = {0: ["--num-gpus=1"], 1: ["--num-gpus=1"]}  # (logical: the engines' test places one on each)
    args = {k: ["--num-cpus=2", *gpus.get(k, [])] for k in range(3)}
    with netns.NetnsCluster(3, ray_args=args) as c:
        yield c
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    assert "relaxn" not in out.stdout  # torn down, namespaces and all


def _flags(inputs, out: Path, *extra: str, **flags) -> list[str]:
    """3 steps of 8 samples, fully async with one step of staleness, checkpointed every step (what a
    restarted trainer starts from); two optimizer steps per batch, so ActorFwd runs."""
    run = dict(
        n_samples_per_prompt=2, num_rollout=STEPS, eval_interval=STEPS, trace=False, global_batch_size=4
    )
    run["kl_coef"] = 0.01  # (the reference runs)
    ckpt = dict(save=out / "ckpt", save_interval=1, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    run["eval_data"] = inputs.eval_path
    run["max_staleness"] = 1 if "--fully-async" in extra else 0
    return run_flags(inputs, out, *extra, **{**run, **ckpt, **flags})


def _prompts(record: dict) -> collections.Counter:
    return collections.Counter(p for step in record["audit"]["trained_prompts"] for p in step)


@pytest.fixture(scope="module")
def spread(cluster, tiny_run_inputs, tmp_path_factory):
    """The fully-async run with its roles on the three nodes, uninterrupted."""
    out = tmp_path_factory.mktemp("spread") / "run"
    roles = ",".join(f"{r}={a}" for r, a in PLACEMENT.items())
    return drive(cluster, out, _flags(tiny_run_inputs, out, "--fully-async", "--role-nodes", roles))


def test_a_fully_async_run_on_three_nodes_trains_as_on_one(cluster, spread, tiny_run_inputs, tmp_path):
    """Every role on the node --role-nodes gave it (the bus on the driver's), the weights crossing nodes
    every step (the trainer's group has its rendezvous at the trainer's node address), and the run trains
    the prompts, and evaluates as, the same run on one node (same seed)."""
    placement = spread["audit"]["placement"]
    assert {r: placement[r] for r in PLACEMENT} == PLACEMENT
    assert placement["bus"] == placement["advantages"] == "10.77.0.1"
    assert not spread["audit"]["health"]
    one_flags = _flags(tiny_run_inputs, tmp_path / "one", "--fully-async", save_interval=1000)  # (no restart)
    one = drive(cluster, tmp_path / "one", one_flags)
    assert set(one["audit"]["placement"].values()) == {"10.77.0.1"}
    assert _prompts(spread) == _prompts(one)
    assert [h["step"] for h in spread["history"] if "train/loss" in h] == list(range(1, STEPS + 1))
    assert [s for s, _ in spread["eval_curve"]] == [0, STEPS]
    assert spread["eval_curve"] == one["eval_curve"]


TOKEN = "netns-elastic-token"


def _call(base: str, method: str, path: str, body=None, token: str | None = TOKEN) -> tuple[int, dict]:
    return call(base, method, path, body, token)


def _op(base: str, body: dict, path: str = "/elastic/scale_out", busy: dict | None = None) -> dict:
    """Start a scaling operation and wait for its end; the operation. ``busy``: what a scale-in asked
    meanwhile got (409: one operation at a time)."""
    code, op = _call(base, "POST", path, body)
    assert code == 202, op
    if busy is not None:
        busy["code"] = _call(base, "POST", "/elastic/scale_in", {"num_replicas": 1})[0]
    deadline = time.monotonic() + 240
    while op["state"] not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, op
        time.sleep(0.2)
        op = _call(base, "GET", f"/elastic/operations/{op['id']}")[1]
    return op


def test_the_elastic_api_scales_engines_across_nodes(cluster, tiny_run_inputs, tmp_path):
    """The rollout on node 2 with engine processes and the elastic API bound to its node's address
    (``--elastic-host node``, so the token is required): called from another address, a scale-out that
    names node 3 launches an engine there (it serves at node 3's address), an engine server started on node
    3 joins by URL, both serve with the current weights, and a scale-in while generating removes them; the
    run loses no sample and sees no failure; the REST errors are the documented ones (401, 400, 404, 409),
    a retried request id gets the same operation, and an engine's and the pool's metrics move. The run is
    longer than the scenario, which stops it. The weights go by delta sync in bf16 (#53): every version the
    engines held, the joined ones' included, is bitwise the trainer's. (Where this runs, it stands in for the
    one-node ``tests/test_elastic_run.py``.)"""
    out, seen = tmp_path / "elastic", {}
    elastic = dict(rollout_engines=1, elastic_port=0, elastic_host="node", elastic_token=TOKEN)
    run = dict(num_rollout=100000, eval_interval=100000, save_interval=100000, drain_timeout_s=0.2)
    run["trace"] = True  # (the engines' rows on the run's timeline)
    run["heartbeat_timeout_s"] = 30.0  # (no fault here: a busy CI machine must not restart a role)
    delta = dict(dtype="bfloat16", lr=1e-5, verify_weight_sync=True)  # (#53: delta sync to joining engines)
    flags = _flags(
        tiny_run_inputs,
        out,
        "--fully-async",
        "--weight-sync-delta",
        "--role-nodes",
        "rollout=10.77.0.2",
        **run,
        **elastic,
        **delta,
    )
    far = cluster.nodes[2]
    serve = [sys.executable, "-m", "relax_rollout.server", "--model", tiny_run_inputs.model_path]
    serve += ["--host", far.ip, "--port", "0", "--token", TOKEN, "--torch-threads", "1"]
    serve += ["--dtype", "bfloat16"]  # (the run's: an engine in another dtype holds other bytes)

    def scenario(out: Path) -> None:
        # the engine server on node 3 starts meanwhile (CI seconds); it joins by URL below
        ext = subprocess.Popen(far.exec_argv(serve), env=cluster.env(), stdout=subprocess.PIPE, text=True)
        try:
            after_step(out, 1)
            base = seen["base"] = json.loads((out / "elastic.json").read_text())["url"]
            seen["401"] = _call(base, "GET", "/elastic/engines", token=None)[0]
            seen["404"] = _call(base, "GET", "/elastic/operations/nope")[0]
            seen["400"] = _call(base, "POST", "/elastic/scale_out", {"num_replicas": "two"})
            body = {"num_replicas": 2, "node": far.ip, "request_id": "out-1"}
            seen["ray"] = _op(base, body, busy=seen.setdefault("busy", {}))
            seen["again"] = _call(base, "POST", "/elastic/scale_out", body)  # a client's retry
            url = next(ln for ln in ext.stdout if "listening on" in ln).strip().rsplit(" ", 1)[-1]
            seen["external"] = _op(base, {"engine_urls": [url]})
            seen["joined_at"] = last_step(out)
            scrapes = [scrape(url + "/metrics", TOKEN)]  # a Prometheus scrape of an engine, as load comes
            k = last_step(out)
            after_step(out, k + 2)  # the three engines serve
            seen["scrapes"] = [*scrapes, scrape(url + "/metrics", TOKEN)]
            seen["engines"] = _call(base, "GET", "/elastic/engines")[1]["data"]
            seen["metrics"] = scrape(base + "/elastic/metrics", TOKEN)
            seen["in"] = _op(base, {"num_replicas": 1}, "/elastic/scale_in")
            after_step(out, last_step(out) + 1)  # on with the start-up engine alone
        finally:
            stop(out)
            ext.kill()

    record = drive(cluster, out, flags, scenario)
    assert seen["base"].startswith("http://10.77.0.2:") and seen["401"] == 401 and seen["404"] == 404
    assert seen["busy"]["code"] == 409 and seen["400"][0] == 400 and seen["400"][1]["param"] == "num_replicas"
    assert seen["again"][0] == 200 and seen["again"][1]["id"] == seen["ray"]["id"]  # (idempotent)
    before, after = seen["scrapes"]  # the engine's metrics moved with the load it took
    for name in ("sglang:generation_tokens_total", "sglang:num_requests_total", "relax:weight_version"):
        assert series(after, name) > series(before, name), name
    pool = seen["metrics"]
    assert pool['relax:elastic_operations_total{kind="scale_out",state="succeeded"}'] == 2, pool
    assert pool['relax:elastic_engines{state="active"}'] == 3 and pool["relax:elastic_prompts_total"] > 0
    for key in ("ray", "external", "in"):
        assert seen[key]["state"] == "succeeded", seen[key]
    engines = {e["kind"]: e for e in seen["engines"]}
    assert engines["startup"]["url"].startswith("http://10.77.0.2:")
    assert engines["ray_native"]["url"].startswith(f"http://{far.ip}:")
    assert engines["ray_native"]["node"] == far.ip
    assert engines["external"]["url"].startswith(f"http://{far.ip}:")
    assert not record["audit"]["health"], record["audit"]["health"]  # (a restarted rollout has new engines)
    final = {e["kind"]: e for e in record["audit"]["engines"]}
    for kind in ("ray_native", "external"):  # joined with the then-current weights, served, drained away
        assert final[kind]["served"] > 0 and final[kind]["state"] == "removed", final
    trained = [h["step"] for h in record["history"] if "train/loss" in h]
    assert trained == list(range(1, len(trained) + 1))
    assert final["startup"]["state"] == "active" and final["startup"]["weight_version"] == len(trained)
    ids = record["audit"]["trained_ids"]
    assert len(ids) == len(set(ids)) == 8 * len(trained)
    _check_delta_sync_to_every_engine(out, seen["joined_at"], len(trained))
    _check_engines_on_the_timeline(out)


def _check_engines_on_the_timeline(out: Path) -> None:
    """`relax ui`'s timeline (#56): each engine on a row of its own; the two that joined mid-run begin
    after the run's first trained step and end (drained, removed) before the start-up engine's row does."""
    from relax_app.ui.data import RunView

    spans = [s for s in RunView(out).timeline()["spans"] if s["role"].startswith("engine ")]
    rows: dict[str, list[dict]] = {}
    for s in spans:
        rows.setdefault(s["args"]["kind"], []).append(s)
    assert set(rows) == {"startup", "ray_native", "external"}, sorted(rows)
    first_step = min(s["ts"] + s["dur"] for s in RunView(out).timeline()["spans"] if s["name"] == "train")
    end = {kind: max(s["ts"] + s["dur"] for s in row) for kind, row in rows.items()}
    for kind in ("ray_native", "external"):
        names = [s["name"] for s in sorted(rows[kind], key=lambda s: s["ts"])]
        assert names[0] == "engine joining" and "engine active" in names, names
        assert min(s["ts"] for s in rows[kind]) > first_step and end[kind] < end["startup"], (kind, end)


def _check_delta_sync_to_every_engine(out: Path, joined_at: int, steps: int) -> None:
    """#53 with elastic engines: the weights went by delta (--weight-sync-delta) and every version the
    rollout loaded — once the engines joined, the pool's checksum, which all its active engines must agree
    on — is bitwise the trainer's, the versions after the join included."""
    audit = read_audit(out)
    sent, held = audit["actor"], audit["rollout"]
    assert set(held) <= set(sent) and max(held) >= joined_at + 2, (sorted(held), joined_at)
    wrong = sorted(v for v, c in held.items() if c != sent[v])
    assert not wrong, f"versions the engines held that differ from the trainer's: {wrong}"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    shares = [
        r["perf/weight_sync_sent_bytes"] / r["perf/weight_sync_bytes"] for r in rows if "train/loss" in r
    ]
    # the first full, then deltas (a full one every --weight-sync-full-every versions)
    assert shares[0] >= 1.0 and sum(s < 0.5 for s in shares) >= 0.9 * steps, shares


def _faulty_run(cluster, inputs, out: Path, fault, **flags) -> dict:
    roles = ",".join(f"{r}={a}" for r, a in PLACEMENT.items())
    return drive(cluster, out, _flags(inputs, out, "--fully-async", "--role-nodes", roles, **flags), fault)


def _check_recovered(record: dict, spread: dict, role: str) -> None:
    """``role`` alone failed, was restarted in place on the driver's node with its recovery time recorded,
    and the run trained exactly the uninterrupted run's prompts, each once."""
    events = record["audit"]["health"]
    assert [(e["role"], e["action"]) for e in events] == [(role, "restart")], events
    assert events[0]["recovery_s"] is not None, events
    print(f"recovery of the {role}: {events[0]['recovery_s']:.1f} s ({events[0]['reason'][:70]})")
    assert record["audit"]["placement"][role] == "10.77.0.1"  # (the driver's node)
    assert _prompts(record) == _prompts(spread)
    ids = record["audit"]["trained_ids"]
    assert len(ids) == len(set(ids)) == STEPS * 8


def _check_run_explorer(run_dir: Path) -> None:
    """`relax ui` on this multi-node run's directory (#56): nothing missing, each step's samples, every role's
    phases on the timeline and the trainer's restart among its events."""
    from relax_app.ui.data import RunView

    view = RunView(run_dir)
    overview = view.overview()
    assert overview["problems"] == [] and overview["sample_steps"] == list(range(1, STEPS + 1)), overview
    timeline = view.timeline()
    assert {"actor", "rollout", "advantages"} <= {s["role"] for s in timeline["spans"]}
    assert [(e["role"], e["action"]) for e in timeline["events"]] == [("actor", "restart")], timeline[
        "events"
    ]
    assert all(g["samples"] for g in view.samples(STEPS)["groups"])


def test_a_killed_node_loses_nothing(cluster, spread, tiny_run_inputs, tmp_path):
    """The trainer's node killed after step 1 (its raylet and every process in its namespace): the trainer
    is restarted on the driver's node from its last checkpoint and the run trains exactly the uninterrupted
    run's prompts; the node's Ray, started again (as an operator would), joins the cluster."""
    node = cluster.nodes[2]

    def kill(out: Path) -> None:
        after_step(out, 1)
        assert node.kill() > 0

    # (rewards 2 s late: the last step waits on the rollout, so the kill lands mid-run; without it the last
    # two steps could finish before the kill did, and the trainer died writing its end-of-run checkpoint)
    try:
        run = _faulty_run(cluster, tiny_run_inputs, tmp_path / "kill", kill, reward_delay_s=2.0, trace=True)
        _check_recovered(run, spread, "actor")
        _check_run_explorer(tmp_path / "kill")
    finally:  # (the node back whatever happened: the next tests place roles on it)
        cluster.ray_start(node)
        cluster.wait_for_nodes(3)


def test_a_node_cut_off_the_network_loses_nothing_and_rejoins(cluster, spread, tiny_run_inputs, tmp_path):
    """The rollout's node cut off the network once the run has evaluated before its first step, for twice
    the heartbeat time-out, then back:
    the rollout's heartbeat goes unanswered, it is restarted on the driver's node (its journal says where
    to go on), the run trains exactly the uninterrupted run's prompts, and the node is in the cluster
    again afterwards (its raylet reconnected, or, had Ray declared it dead meanwhile, started again)."""
    node = cluster.nodes[1]
    cut_s: list[float] = []

    def cut(out: Path) -> None:
        after_step(out, 0)  # (before training: the run cannot end without the rollout meanwhile)
        node.link(up=False)
        t0 = time.monotonic()
        time.sleep(2 * HEARTBEAT_TIMEOUT_S)
        node.link(up=True)
        cut_s.append(time.monotonic() - t0)

    _check_recovered(_faulty_run(cluster, tiny_run_inputs, tmp_path / "cut", cut), spread, "rollout")
    assert cut_s and cut_s[0] >= 2 * HEARTBEAT_TIMEOUT_S
    try:
        cluster.wait_for_nodes(3, timeout_s=30)
    except TimeoutError:  # (Ray declared it dead while it was cut off: its raylet exited)
        node.kill()
        cluster.ray_start(node)
        cluster.wait_for_nodes(3)
    assert cluster.alive_addresses() == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]


def _ranks_on(node) -> int:
    """Megatron rank processes (Ray actors of class _Rank) running in ``node``'s namespace."""
    n = 0
    for pid in node.pids():
        try:
            n += "_Rank" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        except OSError:
            pass
    return n


def test_a_colocate_megatron_run_with_a_rank_on_each_of_two_nodes(cluster, tiny_run_inputs, tmp_path):
    """Colocate with a megatron trainer of two data-parallel ranks, one per node (``--actor-num-nodes 2``):
    rank 0 in the driver on the head, rank 1 a Ray actor on the next node, their gloo group (and megatron's
    groups) across the namespaces; the run evaluates as the same run with both ranks on one node."""
    mg = ["--colocate", "--train-backend", "megatron", "--actor-num-gpus-per-node", "1"]
    seen: list[int] = []

    def look(out: Path) -> None:  # rank 1's process, from the run's first record until its step
        after_step(out, 0)
        while not (n := _ranks_on(cluster.nodes[1])) and last_step(out) < 1:
            time.sleep(0.2)
        seen.append(n)

    # (CI minutes, two megatron runs: one step, no checkpoint, no reference model)
    short = dict(num_rollout=1, save_interval=1000, kl_coef=0.0)
    two = tmp_path / "two"
    spread = drive(cluster, two, _flags(tiny_run_inputs, two, *mg, "--actor-num-nodes", "2", **short), look)
    assert seen == [1]  # rank 1 ran on the second node
    one = tmp_path / "one"
    flags = _flags(tiny_run_inputs, one, "--colocate", "--train-backend", "megatron", **short)
    alone = drive(cluster, one, [*flags, "--actor-num-gpus-per-node", "2"])
    assert [s for s, _ in spread["eval_curve"]] == [0, 1]
    assert spread["eval_curve"] == alone["eval_curve"]
    losses = [[h["train/loss"] for h in r["history"] if "train/loss" in h] for r in (spread, alone)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


@pytest.mark.parametrize(
    "real", [False, pytest.param(True, marks=pytest.mark.real_sglang)], ids=["ours", "sglang"]
)
def test_engines_on_two_nodes_take_a_broadcast_on_the_weight_group(cluster, tiny_run_inputs, tmp_path, real):
    """SGLang-protocol engines on two nodes (one each, logical GPUs): the remote one serves at its node's
    address behind the token, loads versions from the shared directory, is restarted on its node when
    killed (ours); the weight group's rendezvous is the head's address and every member binds its own node's
    (``GLOO_SOCKET_IFNAME`` set for the remote engine's process); a version broadcast on it reaches both,
    and both generate. Once with our engine server standing in for SGLang, once with the real SGLang on CPU
    (its venv: ``tools/sglang-cpu/setup.sh``), each engine in its node's namespace
    (``tests/_netns_engines.py``)."""
    script = Path(__file__).with_name("_netns_engines.py")
    argv = [sys.executable, str(script), tiny_run_inputs.model_path, str(tmp_path), cluster.address]
    if not real and os.environ.get("RELAX_REQUIRE_REAL_SGLANG") == "1":
        pytest.skip("CI runs the real SGLang variant (CI minutes); ours runs where the real one may not")
    if real:
        from relax_rollout.engines import sglang_cpu

        sglang_cpu.require_python()
        argv.append("--real-sglang")
    out = subprocess.run(
        cluster.head.exec_argv(argv), env=cluster.env(), capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print("engines across nodes:", {k: got[k] for k in ("seconds", "left")})
    assert got["urls"][-1].startswith("http://10.77.0.2:")  # the remote engine at its node's address
    assert real or got["urls"][0].startswith("http://127.0.0.1:")  # (ours: one here too, on loopback)
    assert got["remote_env"] == {"CUDA_VISIBLE_DEVICES": "0", "GLOO_SOCKET_IFNAME": cluster.nodes[1].veth}
    assert got["unauthenticated"] == 401 and not got["token_logged"]
    assert got["generated"] == got["generated_after"] == 4 and all(n >= 1 for n in got["served"])
    assert real or got["restarted_on"]  # the killed remote engine came back on its node
    assert got["group_size"] == len(got["urls"]) and got["changed"]
    assert got["left"] == [], got["left_members"]
