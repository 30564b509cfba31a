"""The elastic rollout REST API over an EnginePool of real engine servers (tiny TorchEngines served over
HTTP in threads; "launched" engines are more of them): scale out by URL and by replica count (newcomers
hold the current weights before they serve), scale in with requests in flight (every prompt answered),
every status code, cancel with rollback, idempotent request ids, protected start-up engines, auth and the
OpenAPI document."""

import json
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.elastic import ROUTES, ElasticService, make_elastic_server  # noqa: E402
from relax_rollout.elastic_api import EngineList, Operation  # noqa: E402
from relax_rollout.engines import SamplingParams  # noqa: E402
from relax_rollout.engines.pool import EnginePool  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402
from relax_rollout.engines.wire import http_json  # noqa: E402
from relax_rollout.server.served import ServedEngine  # noqa: E402
from relax_testing import SlowEngine, in_background, wait_until  # noqa: E402

EOS = 1
PROMPTS = [
    [3, 12, 4, 13],
    [7, 12, 8, 12, 9, 13],
    [4, 13],
    [5, 5, 12, 6, 13],
    [9, 9],
    [3, 4, 5],
    [6, 12, 7],
    [8],
]
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def serve(tiny_model_dir):
    started = []

    def start(delay: float = 0.0) -> ServedEngine:
        engine = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)
        s = ServedEngine(SlowEngine(engine, delay))
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture
def api(serve):
    """``api(token=None, launcher=True, gate=None, cancel_wait_s=10.0)``: two protected start-up engines in
    a pool, an ElasticService and its REST server; ``gate`` (an Event) holds every launch until set."""
    made = []

    def make(token=None, launcher=True, gate=None, cancel_wait_s=10.0):
        launched: list[ServedEngine] = []
        nodes: list[str | None] = []  # the node each launch was asked for
        launching = threading.Event()  # a launch has begun (and waits for the gate, if any)

        def launch(node=None):
            launching.set()
            if gate is not None:
                assert gate.wait(20)
            s = serve()
            launched.append(s)
            nodes.append(node)
            return s.url, s

        pool = EnginePool(
            [serve().url, serve().url],
            launch=launch if launcher else None,
            kill=lambda s: s.close(),
        )
        svc = ElasticService(pool, drain_timeout_s=5.0, cancel_wait_s=cancel_wait_s)
        httpd = make_elastic_server(svc, token=token)
        threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
        made.append((httpd, pool))
        return SimpleNamespace(
            pool=pool,
            svc=svc,
            url=f"http://127.0.0.1:{httpd.server_address[1]}",
            launched=launched,
            nodes=nodes,
            launching=launching,
        )

    yield make
    for httpd, pool in made:
        httpd.shutdown()
        httpd.server_close()
        pool.close()


def wait_op(call, a, op_id, token=None, timeout=30.0, until=TERMINAL):
    deadline = time.monotonic() + timeout
    while True:
        code, op = call(a.url, f"/elastic/operations/{op_id}", token=token)
        assert code == 200, op
        if op["state"] in until:
            return op
        assert time.monotonic() < deadline, f"operation stuck: {op}"
        time.sleep(0.02)


def scrape(url: str, token: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        return r.read().decode()


def raw_post(url: str, path: str, data: bytes):
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_scale_out_by_url_joins_with_the_current_weights(api, serve, call, local):
    a = api(launcher=False)
    g = torch.Generator().manual_seed(3)
    new = {n: torch.randn(w.shape, generator=g) for n, w in local.named_weights() if n.startswith("lm_head")}
    a.pool.update_weights(new, 4)
    newcomer = serve()
    assert http_json(newcomer.url, "/get_model_info")["weight_version"] == "0"
    stop, seen = threading.Event(), set()

    def traffic():  # requests keep flowing while the engine joins
        while not stop.is_set():
            outs = a.pool.generate(PROMPTS, SamplingParams(max_new_tokens=4, greedy=True))
            seen.update(o.weight_version for o in outs)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        code, op = call(a.url, "/elastic/scale_out", {"engine_urls": [newcomer.url + "/"]})
        assert code == 202 and op["kind"] == "scale_out" and op["state"] in ("pending", "running")
        op = wait_op(call, a, op["id"])
        assert op["state"] == "succeeded" and op["engines_added"] == ["e2"] and op["error"] is None
        Operation.model_validate(op)
        assert op["started"] >= op["created"] and op["finished"] >= op["started"]
        wait_until(lambda: newcomer.state.engine.versions)  # it gets traffic now
    finally:
        stop.set()
        t.join(30)
    assert http_json(newcomer.url, "/get_model_info")["weight_version"] == "4"
    sums = {http_json(m.url, "/weights_checksum")["checksum"] for m in a.pool.membership.active()}
    assert len(sums) == 1 and a.pool.weights_checksum() in sums
    assert set(newcomer.state.engine.versions) == {4} and seen == {4}  # never served the old weights
    code, eng = call(a.url, "/elastic/engines")
    assert code == 200 and eng["active"] == 3 and eng["weight_version"] == 4
    e2 = [m for m in eng["data"] if m["id"] == "e2"][0]
    assert (e2["kind"], e2["state"], e2["protected"], e2["weight_version"]) == (
        "external",
        "active",
        False,
        4,
    )
    assert e2["url"] == newcomer.url
    metrics = scrape(a.url + "/elastic/metrics")  # Prometheus, for an autoscaler
    for line in (
        'relax:elastic_engines{state="active"} 3',
        "relax:elastic_weight_version 4",
        'relax:elastic_operations_total{kind="scale_out",state="succeeded"} 1',
        "relax:elastic_operation_seconds_scale_out_count 1",
        'relax:elastic_engine_inflight{engine="e2"',
    ):
        assert line in metrics, metrics
    # an engine that does not answer: the op fails and removes what it added before
    from relax_core.net import free_port

    a.pool.membership.join_timeout_s = 0.3
    other = serve()
    code, op = call(
        a.url, "/elastic/scale_out", {"engine_urls": [other.url, f"http://127.0.0.1:{free_port()}"]}
    )
    assert code == 202
    op = wait_op(call, a, op["id"])
    assert op["state"] == "failed" and "could not join" in op["error"]
    assert op["engines_added"] == ["e3"] and op["rollback"] == ["removed e3"]
    assert [m["id"] for m in a.pool.membership.members()] == ["e0", "e1", "e2"]


def test_scale_out_by_replicas_is_idempotent_by_request_id(api, call):
    a = api()
    body = {"num_replicas": 4, "request_id": "grow-1"}
    code, op = call(a.url, "/elastic/scale_out", body)
    assert code == 202 and op["request_id"] == "grow-1"
    code, again = call(a.url, "/elastic/scale_out", body)  # a client retry: the same operation
    assert code == 200 and again["id"] == op["id"]
    op = wait_op(call, a, op["id"])
    assert op["state"] == "succeeded" and sorted(op["engines_added"]) == ["e2", "e3"]
    code, again = call(a.url, "/elastic/scale_out", body)  # still the same one after it finished
    assert code == 200 and again["id"] == op["id"] and again["state"] == "succeeded"
    code, err = call(a.url, "/elastic/scale_out", {"num_replicas": 5, "request_id": "grow-1"})
    assert code == 409 and "request_id" in err["message"] and err["operation"] == op["id"]
    kinds = {m["id"]: (m["kind"], m["protected"], m["weight_version"]) for m in a.pool.membership.members()}
    assert kinds == {
        "e0": ("startup", True, 0),
        "e1": ("startup", True, 0),
        "e2": ("ray_native", False, 0),
        "e3": ("ray_native", False, 0),
    }
    code, same = call(a.url, "/elastic/scale_out", {"num_replicas": 4})  # already there: nothing to do
    assert code == 202 and wait_op(call, a, same["id"])["engines_added"] == []
    code, ops = call(a.url, "/elastic/operations")
    assert code == 200 and [o["id"] for o in ops["data"]] == [op["id"], same["id"]]
    # scale in to 2 by count: the newest non-protected go first, and their processes are killed
    code, op = call(a.url, "/elastic/scale_in", {"num_replicas": 2})
    assert code == 202 and op["targets"] == ["e3", "e2"]
    assert wait_op(call, a, op["id"])["state"] == "succeeded"
    assert all(s.closed for s in a.launched) and len(a.pool.membership.active()) == 2


def test_scale_in_with_requests_in_flight_answers_every_prompt(api, serve, call, local):
    a = api(launcher=False)
    a.pool.membership.add(serve().url)  # e2
    a.pool.membership.add(serve(delay=0.05).url)  # e3: slow, still generating at the drain time-out
    params = SamplingParams(max_new_tokens=40, greedy=True, min_new_tokens=40)
    want = local.generate(PROMPTS, params)
    result = in_background(a.pool.generate, PROMPTS, params)
    wait_until(lambda: a.pool.membership.get("e3").inflight > 0)
    code, op = call(a.url, "/elastic/scale_in", {"num_replicas": 2, "drain_timeout_s": 0.5})
    assert code == 202 and op["targets"] == ["e3", "e2"]
    op = wait_op(call, a, op["id"])
    assert op["state"] == "succeeded" and sorted(op["engines_removed"]) == ["e2", "e3"]
    outs = result()
    assert len(outs) == len(PROMPTS) and all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    st = a.pool.stats()
    # e3's 2 prompts were aborted and re-issued (e2's too if it had not finished within 0.5 s)
    assert st["aborts_reissued"] == st["reissued_prompts"] in (2, 4) and st["failures"] == 0
    assert [m["id"] for m in a.pool.membership.members()] == ["e0", "e1"]
    code, eng = call(a.url, "/elastic/engines?include_removed=true")
    assert code == 200 and [(m["id"], m["state"]) for m in eng["data"]][2:] == [
        ("e2", "removed"),
        ("e3", "removed"),
    ]
    assert eng["active"] == 2 and eng["stats"]["aborts_reissued"] == st["aborts_reissued"]


def test_validation_errors_are_400_naming_the_field(api, call):
    a = api(launcher=False)
    cases = [
        ("/elastic/scale_out", [1, 2], "body", "JSON object"),
        ("/elastic/scale_out", {"nmu_replicas": 2}, "nmu_replicas", "allowed: num_replicas, engine_urls"),
        ("/elastic/scale_out", {}, "num_replicas", "exactly one of num_replicas, engine_urls"),
        ("/elastic/scale_out", {"num_replicas": "3"}, "num_replicas", "must be an integer"),
        ("/elastic/scale_out", {"num_replicas": -1}, "num_replicas", "must be ≥ 1"),
        ("/elastic/scale_out", {"num_replicas": 3}, "num_replicas", "no engine launcher"),
        (
            "/elastic/scale_out",
            {"num_replicas": 3, "engine_urls": ["http://h:1"]},
            "engine_urls",
            "exactly one",
        ),
        ("/elastic/scale_out", {"engine_urls": ["ftp://h:1"]}, "engine_urls[0]", "http:// or https://"),
        ("/elastic/scale_out", {"engine_urls": []}, "engine_urls", "non-empty list"),
        ("/elastic/scale_out", {"engine_urls": ["http://h:1", "http://h:1/"]}, "engine_urls", "twice"),
        ("/elastic/scale_out", {"engine_urls": ["http://h:1"], "request_id": 5}, "request_id", "string"),
        ("/elastic/scale_in", {"engine_ids": ["e0"]}, "engine_ids[0]", "protected start-up engine"),
        ("/elastic/scale_in", {"num_replicas": 1}, "num_replicas", "protected start-up engines (e0, e1)"),
        ("/elastic/scale_in", {"num_replicas": 0}, "num_replicas", "must be ≥ 1"),
        ("/elastic/scale_in", {"num_replicas": 3}, "num_replicas", "use /elastic/scale_out"),
        ("/elastic/scale_in", {"engine_ids": ["e9"]}, "engine_ids[0]", "unknown engine"),
        ("/elastic/scale_in", {"engine_urls": ["http://127.0.0.1:1"]}, "engine_urls[0]", "no engine serves"),
        ("/elastic/scale_in", {"engine_ids": ["e2"], "drain_timeout_s": -1}, "drain_timeout_s", "≥ 0"),
        ("/elastic/scale_in", {"engine_ids": ["e2"], "force": "yes"}, "force", "true or false"),
    ]
    for path, body, field, words in cases:
        code, err = call(a.url, path, body)
        assert code == 400, (body, err)
        assert err["param"] == field and field in err["message"] and words in err["message"], (body, err)
    code, err = raw_post(a.url, "/elastic/scale_out", b"{not json")
    assert code == 400 and err["param"] == "body" and "not valid JSON" in err["message"]
    assert call(a.url, "/elastic/operations")[1]["data"] == []  # nothing was started
    # the last engine is never removed, even when none is protected
    a.pool.membership.get("e0").protected = a.pool.membership.get("e1").protected = False
    code, err = call(a.url, "/elastic/scale_in", {"engine_ids": ["e0", "e1"]})
    assert code == 400 and err["param"] == "engine_ids" and "at least 1 must remain" in err["message"]


def test_a_scale_out_on_a_named_node(api, call):
    """Multi-node runs (--elastic-host node) launch engines on the node a scale-out names, an alive one;
    a restart asks for the same node again. Loopback-bound runs refuse a node, saying what to start with."""
    a = api()
    code, err = call(a.url, "/elastic/scale_out", {"num_replicas": 3, "node": "10.0.0.2"})
    assert code == 400 and err["param"] == "node" and "--elastic-host node" in err["message"]
    a.svc.nodes = lambda: ["10.0.0.1", "10.0.0.2"]
    code, err = call(a.url, "/elastic/scale_out", {"num_replicas": 3, "node": "10.0.0.9"})
    assert code == 400 and "no alive node at 10.0.0.9" in err["message"] and "10.0.0.2" in err["message"]
    code, err = call(a.url, "/elastic/scale_out", {"engine_urls": ["http://h:1"], "node": "10.0.0.2"})
    assert code == 400 and err["param"] == "node" and "only with num_replicas" in err["message"]
    assert a.launched == []
    code, op = call(a.url, "/elastic/scale_out", {"num_replicas": 3, "node": "10.0.0.2"})
    assert code == 202 and wait_op(call, a, op["id"])["state"] == "succeeded"
    assert a.nodes == ["10.0.0.2"]
    code, eng = call(a.url, "/elastic/engines")
    assert [m["node"] for m in eng["data"]] == [None, None, "10.0.0.2"]
    a.pool.membership.restart("e2")
    assert a.nodes == ["10.0.0.2", "10.0.0.2"] and a.pool.membership.get("e3").node == "10.0.0.2"


def test_a_scale_out_past_the_clusters_room_is_refused_before_anything_launches(api, call):
    """{"num_replicas": 1000000} was accepted: 8 engines were launched before a cancel stopped it."""
    a = api()
    a.svc.max_engines = 4  # (a run: --elastic-max-engines, else the Ray cluster's CPUs)
    code, err = call(a.url, "/elastic/scale_out", {"num_replicas": 1000000})
    assert code == 400 and err["param"] == "num_replicas" and "room for" in err["message"]
    assert a.launched == [] and call(a.url, "/elastic/operations")[1]["data"] == []
    code, op = call(a.url, "/elastic/scale_out", {"num_replicas": 3})
    assert code == 202 and wait_op(call, a, op["id"])["state"] == "succeeded"


def test_conflict_cancel_and_rollback_of_a_scale_out(api, call):
    gate = threading.Event()
    a = api(gate=gate, cancel_wait_s=0.2)
    code, op = call(a.url, "/elastic/scale_out", {"num_replicas": 3})
    assert code == 202
    wait_op(call, a, op["id"], until=("running",))
    code, err = call(a.url, "/elastic/scale_in", {"engine_ids": ["e1"]})
    assert code == 409 and err["operation"] == op["id"] and "cancel it" in err["message"]
    code, err = call(a.url, "/elastic/scale_out", {"num_replicas": 4})
    assert code == 409
    # (cancelled before its launch began, the operation has nothing to roll back and ends within the
    # cancel's wait: on a loaded machine that raced the 202 this test is about)
    assert a.launching.wait(20)
    code, cancelling = call(a.url, f"/elastic/operations/{op['id']}/cancel", {})
    assert code == 202 and cancelling["cancel_requested"] and cancelling["state"] == "running"
    gate.set()  # the launch finishes; the cancelled operation removes the engine it added
    done = wait_op(call, a, op["id"])
    assert (
        done["state"] == "cancelled"
        and done["engines_added"] == ["e2"]
        and done["rollback"] == ["removed e2"]
    )
    assert [m["id"] for m in a.pool.membership.members()] == ["e0", "e1"] and a.launched[0].closed
    code, err = call(a.url, f"/elastic/operations/{op['id']}/cancel", {})
    assert code == 409 and "already cancelled" in err["message"]
    assert call(a.url, "/elastic/operations/op-99/cancel", {})[0] == 404
    assert call(a.url, "/elastic/operations/op-99")[0] == 404


def test_cancel_of_a_scale_in_reactivates_and_re_adds(api, serve, call):
    a = api(launcher=False)
    fast, slow = serve(), serve(delay=0.05)
    a.pool.membership.add(fast.url)  # e2
    a.pool.membership.add(slow.url)  # e3
    params = SamplingParams(max_new_tokens=60, greedy=True, min_new_tokens=60)
    result = in_background(a.pool.generate, PROMPTS, params)
    wait_until(lambda: a.pool.membership.get("e3").inflight > 0)
    code, op = call(a.url, "/elastic/scale_in", {"engine_urls": [fast.url, slow.url], "drain_timeout_s": 60})
    assert code == 202 and op["targets"] == ["e2", "e3"]
    wait_until(lambda: call(a.url, f"/elastic/operations/{op['id']}")[1]["engines_removed"] == ["e2"])
    assert a.pool.membership.get("e3").state == "draining"
    code, done = call(a.url, f"/elastic/operations/{op['id']}/cancel", {})
    assert code == 200 and done["state"] == "cancelled"
    assert done["engines_removed"] == ["e2"] and done["engines_added"] == ["e4"]
    assert sorted(done["rollback"]) == ["e2 re-added as e4", "e3 active again"]
    states = {m["id"]: m["state"] for m in a.pool.membership.members(include_removed=True)}
    assert states == {"e0": "active", "e1": "active", "e2": "removed", "e3": "active", "e4": "active"}
    outs = result()  # the drained engine was never aborted: its requests finished there
    assert len(outs) == len(PROMPTS) and all(o.finish_reason == "length" for o in outs)
    assert a.pool.stats()["reissued_prompts"] == 0


def test_auth_unknown_routes_and_openapi(api, call):
    a = api(token="s3cret")
    for path, body in [
        ("/elastic/engines", None),
        ("/elastic/scale_out", {"num_replicas": 3}),
        ("/elastic/openapi.json", None),
        ("/elastic/metrics", None),
        ("/nope", None),
    ]:
        assert call(a.url, path, body)[0] == 401
        assert call(a.url, path, body, token="wrong")[0] == 401
    code, eng = call(a.url, "/elastic/engines", token="s3cret")
    assert code == 200 and [m["id"] for m in eng["data"]] == ["e0", "e1"] and eng["active"] == 2
    EngineList.model_validate(eng)  # the document's models are what the API answers
    assert 'relax:elastic_engines{state="active"} 2' in scrape(a.url + "/elastic/metrics", token="s3cret")
    code, err = call(a.url, "/elastic/nope", token="s3cret")
    assert code == 404 and "openapi.json" in err["message"]
    assert call(a.url, "/elastic/scale_out", token="s3cret")[0] == 404  # GET on a POST route
    assert call(a.url, "/elastic/operations/op-1", token="s3cret")[0] == 404
    with pytest.raises(ValueError, match="not a loopback address"):
        make_elastic_server(a.svc, host="0.0.0.0")
    for blank in (" ", "", "\t"):  # a token of one space was accepted on 0.0.0.0
        with pytest.raises(ValueError, match="the token is blank"):
            make_elastic_server(a.svc, host="0.0.0.0", token=blank)

    code, doc = call(a.url, "/elastic/openapi.json", token="s3cret")
    assert code == 200 and doc["openapi"].startswith("3.1")
    for method, path, _ in ROUTES:
        op = doc["paths"][path][method.lower()]
        assert op["summary"] and "200" in op["responses"] and "401" in op["responses"]
        if method == "POST" and "{id}" not in path:
            assert op["requestBody"]["required"] and {"202", "400", "409"} <= set(op["responses"])
        if "{id}" in path:
            assert "404" in op["responses"] and op["parameters"][0]["name"] == "id"
    assert {(m.lower(), p) for m, p, _ in ROUTES} == {(m, p) for p, ops in doc["paths"].items() for m in ops}
    schemas = doc["components"]["schemas"]
    assert set(schemas["ScaleOutRequest"]["properties"]) == {
        "num_replicas",
        "engine_urls",
        "node",
        "request_id",
    }
    assert set(schemas["ScaleInRequest"]["properties"]) == {
        "num_replicas",
        "engine_ids",
        "engine_urls",
        "drain_timeout_s",
        "force",
        "request_id",
    }
    codes = {c for ops in doc["paths"].values() for o in ops.values() for c in o["responses"]}
    assert codes == {"200", "202", "400", "401", "404", "409"}
