"""Run on the head of ``tests/test_netns_runs.py``'s namespace cluster (``python tests/_netns_engines.py
MODEL TMP RAY_ADDRESS``): two SGLang-protocol engines of one (logical) GPU each, engine 0 on this node and
engine 1 started on the next by its launcher actor, bound to that node's address with a token (control
refused without it, the token not logged). Both load a version from the shared directory and generate; the
remote engine, killed, is restarted on its node with the current weights; then a version broadcast to
both on SGLang's weight group (``--sglang-weight-update distributed``), its rendezvous this node's address;
both generate again; close() leaves no process. Prints what the test checks, as JSON, on its last line.

Our engine server stands in for SGLang (its ``/init_weights_update_group`` makes the group with the same
torch calls SGLang's does); a real SGLang's own group code reads ``GLOO_SOCKET_IFNAME``, which the launcher
sets for engines of a group across nodes (checked here on the remote engine's environment)."""

from __future__ import annotations

import json
import os
import signal
import sys


def main(model: str, tmp: str, address: str, real: bool = False) -> dict:
    """``real``: real SGLang on CPU (``.venv-sglang``) instead of our engine server (by hand: slow for CI)."""
    import ray
    from safetensors.torch import load_file

    from relax_rollout.engines import SamplingParams
    from relax_rollout.engines.processes import group_alive, server_command
    from relax_rollout.engines.sglang import SGLangEngine
    from relax_rollout.engines.wire import ServerError, http_json
    from relax_testing import wait_until

    ray.init(address=address, logging_level="ERROR")
    if real:
        from relax_rollout.engines import sglang_cpu

        backend = {**sglang_cpu.engine_kwargs(sglang_cpu.python()), "gpu_ids": ["0"]}
    else:
        cmd = server_command("--host", "{host}", "--token", "{token}", "--torch-threads", "1")
        backend = {"gpu_ids": ["0"], "launch_cmd": cmd, "startup_timeout_s": 300}
    eng = SGLangEngine(
        model,
        num_engines=2,
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
        local, remote = eng.engines()
        got["urls"] = [local["url"], remote["url"]]
        launcher = eng.launcher.nodes[remote["node_id"]]
        env = ray.get(launcher.environ.remote(remote["pid"]))
        got["remote_env"] = {k: env.get(k) for k in ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME")}
        try:  # off loopback: control needs the token
            http_json(remote["url"], "/pause_generation", {"mode": "abort"})
            got["unauthenticated"] = 200
        except ServerError as e:
            got["unauthenticated"] = e.status
        got["token_logged"] = eng.token in open(os.path.join(tmp, "logs", "engine1.log")).read()
        weights = load_file(os.path.join(model, "model.safetensors"))
        checksum = (lambda: None) if real else eng.pool.weights_checksum  # (SGLang has no checksum route)
        before = checksum()
        eng.update_weights({k: v * 0.5 for k, v in weights.items()}, 1)  # (from the shared directory)
        eng.check_weight_version(1)
        got["generated"] = len(eng.generate(prompts, greedy))
        os.killpg(remote["pid"], signal.SIGKILL)  # the remote engine dies: restarted on its node
        wait_until(
            lambda: len(eng.engines()[1]["pids"]) == 2 and eng.engines()[1]["state"] == "running",
            timeout=300,
            what="engine 1 restarted",
            interval=0.2,
        )
        eng.check_weight_version(1)  # (it loaded the current weights before serving)
        got["restarted_on"] = eng.engines()[1]["node_id"] == remote["node_id"]
        eng.weight_update = "distributed"  # now SGLang's weight group, its rendezvous this node's address
        eng.update_weights({k: v * 0.25 for k, v in weights.items()}, 2)
        eng.check_weight_version(2)
        got["group_size"] = len(eng.weights.group.urls)
        got["changed"] = real or checksum() != before
        got["generated_after"] = len(eng.generate(prompts, greedy))
        got["served"] = [m["served"] for m in eng.pool.members()]
    finally:
        eng.close()
        ray.shutdown()
    got["left"] = [p for s in eng.engines() for p in s["pids"] if group_alive(p)]
    return got


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4], real="--real-sglang" in sys.argv)))
