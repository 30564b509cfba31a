"""Elastic rollout during a running fully-async job: scale out by one ray_native engine and by one
external engine served from another process, then scale in by two while requests are in flight. No
request is lost, every new engine serves with the current weights, and the REST errors are the documented
ones. The run is long (it would outlast the test) and is stopped gracefully once the scenario is done.

Where the namespace tier runs (root, ``ip``: CI), ``tests/test_netns_runs.py`` runs this scenario across
three nodes instead (the API and the engines at node addresses, an engine launched on a named node, the same
checks), and this one-node run is skipped to pay for it in CI minutes; the loopback API and loopback engines
are also covered by ``packages/relax-rollout/tests/test_elastic.py`` and ``engines/test_pool.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller
from relax_testing import netns
from relax_testing.http_calls import call, scrape, series

TOKEN = "elastic-test-token"


def _call(base: str, method: str, path: str, body=None, token: str | None = TOKEN):
    return call(base, method, path, body, token)


def _wait_op(base: str, op_id: str, timeout_s: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code, op = _call(base, "GET", f"/elastic/operations/{op_id}")
        assert code == 200
        if op["state"] in ("succeeded", "failed", "cancelled"):
            return op
        time.sleep(0.2)
    raise AssertionError(f"operation {op_id} did not finish")


def _trained_steps(metrics: Path) -> int:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return sum('"train/loss"' in line for line in lines)


def _wait_steps(metrics: Path, n: int, timeout_s: float = 300.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (k := _trained_steps(metrics)) < n:
        assert time.monotonic() < deadline, f"training stalled at {k} steps"
        time.sleep(0.05)
    return k


def _start_external(model: str) -> tuple[subprocess.Popen, str]:
    serve = [sys.executable, "-m", "relax_rollout.server"]
    proc = subprocess.Popen(
        [*serve, "--model", model, "--port", "0", "--torch-threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in proc.stdout:
        if "listening on" in line:
            return proc, line.strip().rsplit(" ", 1)[-1]
    raise AssertionError("the external engine server did not start")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.skipif(
    netns.available() is None,
    reason="tests/test_netns_runs.py::test_the_elastic_api_scales_engines_across_nodes runs it across nodes here",
)
def test_scale_out_and_in_mid_run(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    # longer than the test (the scenario stops it), one engine at the start, the REST API on a free port
    run = dict(n_samples_per_prompt=2, rollout_max_response_len=8, num_rollout=100000, eval_interval=1000)
    elastic = dict(rollout_engines=1, elastic_port=0, elastic_token=TOKEN, drain_timeout_s=0.2)
    argv = run_flags(tiny_run_inputs, out, "--fully-async", max_staleness=1, trace=False, **run, **elastic)
    cfg = build_config(None, argv)
    c = Controller(cfg, tiny_run_inputs)
    seen: dict = {}
    errors: list[BaseException] = []

    def scenario():
        try:
            metrics = out / "metrics.jsonl"
            _wait_steps(metrics, 2)
            base = json.loads((out / "elastic.json").read_text())["url"]
            # REST errors mid-run: 401 without the token, 400 bad body, 404 unknown op, 409 busy
            seen["401"] = _call(base, "GET", "/elastic/engines", token=None)[0]
            seen["400"] = _call(base, "POST", "/elastic/scale_out", {"num_replicas": "two"})
            seen["404"] = _call(base, "GET", "/elastic/operations/nope")[0]
            code, op = _call(base, "POST", "/elastic/scale_out", {"num_replicas": 2, "request_id": "out-1"})
            assert code == 202, op
            seen["409"] = _call(base, "POST", "/elastic/scale_in", {"num_replicas": 1})
            seen["idempotent"] = _call(
                base, "POST", "/elastic/scale_out", {"num_replicas": 2, "request_id": "out-1"}
            )
            seen["scale_out_ray"] = _wait_op(base, op["id"])
            seen["steps_at_ray"] = _trained_steps(metrics)
            proc, url = _start_external(tiny_run_inputs.model_path)
            seen["proc"] = proc
            code, op = _call(base, "POST", "/elastic/scale_out", {"engine_urls": [url]})
            assert code == 202, op
            seen["scale_out_external"] = _wait_op(base, op["id"])
            scrapes = [scrape(url + "/metrics")]  # a Prometheus scrape of an engine, as load comes
            k = _trained_steps(metrics)
            _wait_steps(metrics, k + 3)  # the three engines serve a few steps
            scrapes.append(scrape(url + "/metrics"))
            seen["scrapes"] = scrapes
            seen["pool_metrics"] = scrape(base + "/elastic/metrics", TOKEN)
            seen["engines_before_in"] = _call(base, "GET", "/elastic/engines")[1]
            code, op = _call(base, "POST", "/elastic/scale_in", {"num_replicas": 1})  # while generating
            assert code == 202, op
            seen["scale_in"] = _wait_op(base, op["id"])
            k = _trained_steps(metrics)
            _wait_steps(metrics, k + 2)  # training goes on with the start-up engine alone
            seen["openapi"] = _call(base, "GET", "/elastic/openapi.json")
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            errors.append(e)
        finally:
            c.request_stop()  # graceful stop (as SIGTERM): checkpoint after the current step

    t = threading.Thread(target=scenario, daemon=True)
    t.start()
    try:
        result = c.run()
    finally:
        t.join(timeout=60)
        if "proc" in seen:
            seen["proc"].kill()
    if errors:
        raise errors[0]

    assert seen["401"] == 401 and seen["404"] == 404
    assert seen["400"][0] == 400 and seen["400"][1]["param"] == "num_replicas"
    assert seen["409"][0] == 409
    assert seen["idempotent"][0] == 200 and seen["idempotent"][1]["state"] in (
        "pending",
        "running",
        "succeeded",
    )
    for key in ("scale_out_ray", "scale_out_external", "scale_in"):
        assert seen[key]["state"] == "succeeded", seen[key]
    # the engine's metrics moved with the load it took; the pool's count its scaling
    before, after = seen["scrapes"]
    for name in ("sglang:generation_tokens_total", "sglang:num_requests_total", "sglang:prompt_tokens_total"):
        assert series(after, name) > series(before, name), (name, before, after)
    assert series(after, "relax:weight_version") > series(before, "relax:weight_version")
    pool = seen["pool_metrics"]
    assert pool['relax:elastic_operations_total{kind="scale_out",state="succeeded"}'] == 2, pool
    assert pool['relax:elastic_engines{state="active"}'] == 3 and pool["relax:elastic_prompts_total"] > 0, (
        pool
    )
    paths = seen["openapi"][1]["paths"]
    assert {"/elastic/scale_out", "/elastic/scale_in", "/elastic/engines"} <= set(paths)

    engines = {e["id"]: e for e in result.audit["engines"]}
    kinds = sorted(e["kind"] for e in engines.values())
    assert kinds == ["external", "ray_native", "startup"], engines
    new = [e for e in engines.values() if e["kind"] != "startup"]
    for e in new:  # joined with the then-current weights, served, then drained away
        assert e["served"] > 0 and e["state"] == "removed", e
    start_up = next(e for e in engines.values() if e["kind"] == "startup")
    trained = [h for h in result.history if "train/loss" in h]
    assert start_up["state"] == "active" and start_up["weight_version"] == len(trained)
    # no request lost: every trained step had its full batch, no sample twice
    ids = result.audit["trained_ids"]
    assert len(ids) == len(set(ids)) == 8 * len(trained)
    assert [h["step"] for h in trained] == list(range(1, len(trained) + 1))
    assert not result.audit["health"], result.audit["health"]  # scaling is not a failure
