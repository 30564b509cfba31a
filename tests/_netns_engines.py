"""Run on the head of ``tests/test_netns_runs.py``'s namespace cluster (``python tests/_netns_engines.py
MODEL TMP RAY_ADDRESS [--real-sglang]``): SGLang-protocol engines of one (logical) GPU each, engine 0 on
this node and engine 1 started on the next by its launcher actor (with ``--real-sglang``: the real SGLang
on CPU, one engine, on the next node only, not restarted: each start costs CI a minute), bound to that
node's address with a token (control refused without it, the token not in its log). They load a version
from the shared directory and generate; the remote engine, killed, is restarted on its node with the
current weights; then a version is broadcast on SGLang's weight group (``--sglang-weight-update distributed``), its
rendezvous this node's address; they generate again; close() leaves no process. Prints what the test
checks, as JSON, on its last line.

Our engine server makes its group with the same torch calls SGLang's does; a real SGLang's own group code
reads ``GLOO_SOCKET_IFNAME``, which the launcher sets for engines of a group across nodes (checked here on
the remote engine's environment)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(model: str, tmp: str, address: str, real: bool = False) -> dict:
    """``real``: one real SGLang on CPU (``.venv-sglang``), on the next node, instead of our two servers."""
    import ray
    from safetensors.torch import load_file

    from relax_rollout.engines import SamplingParams
    from relax_rollout.engines.process_groups import group_alive, group_members
    from relax_rollout.engines.processes import server_command
    from relax_rollout.engines.sglang import SGLangEngine
    from relax_rollout.engines.wire import ServerError, http_json
    from relax_testing import wait_until

    t0 = time.monotonic()
    ray.init(address=address, logging_level="ERROR")
    if real:
        from relax_rollout.engines import sglang_cpu

        backend = {**sglang_cpu.engine_kwargs(sglang_cpu.python()), "gpu_ids": []}  # (none here)
    else:
        cmd = server_command("--host", "{host}", "--token", "{token}", "--torch-threads", "1")
        backend = {"gpu_ids": ["0"], "launch_cmd": cmd, "startup_timeout_s": 300}
    eng = SGLangEngine(
        model,
        num_engines=1 if real else 2,
        gpus_per_node=1,
        **backend,
        weights_dir=os.path.join(tmp, "weights"),
        log_dir=os.path.join(tmp, "logs"),
        max_restarts=1,
        poll_interval_s=0.2,
        shutdown_grace_s=5,
    )
    prompts, greedy = [[3, 4, 5], [6, 7], [8, 9, 10], [11]], SamplingParams(max_new_tokens=4, greedy=True)
    got: dict = {}
    try:
        remote = eng.engines()[-1]
        got["urls"] = [e["url"] for e in eng.engines()]
        launcher = eng.launcher.nodes[remote["node_id"]]
        env = ray.get(launcher.environ.remote(remote["pid"]))
        got["remote_env"] = {k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME")}
        try:  # off loopback: control needs the token
            http_json(remote["url"], "/pause_generation", {"mode": "abort"})
            got["unauthenticated"] = 200
        except ServerError as e:
            got["unauthenticated"] = e.status
        log = os.path.join(tmp, "logs", f"engine{len(got['urls']) - 1}.log")
        got["token_logged"] = eng.token in open(log).read()
        weights = load_file(os.path.join(model, "model.safetensors"))
        checksum = (lambda: None) if real else eng.pool.weights_checksum  # (SGLang has no checksum route)
        before = checksum()
        eng.update_weights({k: v * 0.5 for k, v in weights.items()}, 1)  # (from the shared directory)
        eng.check_weight_version(1)
        got["generated"] = len(eng.generate(prompts, greedy))
        if not real:  # (the real one: a second start costs CI a minute; restarts of real SGLang on one node
            # are tests/engines/test_sglang_real.py's)
            os.killpg(remote["pid"], signal.SIGKILL)  # the remote engine dies: restarted on its node
            wait_until(
                lambda: len(eng.engines()[-1]["pids"]) == 2 and eng.engines()[-1]["state"] == "running",
                timeout=300,
                what="engine 1 restarted",
                interval=0.2,
            )
            eng.check_weight_version(1)  # (it loaded the current weights before serving)
            got["restarted_on"] = eng.engines()[-1]["node_id"] == remote["node_id"]
        eng.weight_update = "distributed"  # now SGLang's weight group, its rendezvous this node's address
        eng.update_weights({k: v * 0.25 for k, v in weights.items()}, 2)
        eng.check_weight_version(2)
        got["group_size"] = len(eng.weights.group.urls)
        got["changed"] = real or checksum() != before
        got["generated_after"] = len(eng.generate(prompts, greedy))
        got["served"] = [m["served"] for m in eng.pool.membership.members()]
    finally:
        eng.close()
        ray.shutdown()
    got["left"] = [p for s in eng.engines() for p in s["pids"] if group_alive(p)]
    got["left_members"] = {
        p: [" ".join(map(str, m)) for m in ms] for p, ms in group_members(got["left"]).items()
    }
    got["seconds"] = round(time.monotonic() - t0, 1)
    return got


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4], real="--real-sglang" in sys.argv)))
