"""EnginePool over real engine servers (tiny TorchEngines served over HTTP in threads): batches spread over
the members and equal one engine's; a member dying mid-batch or answering 5xx has its prompts re-issued;
weight updates reach every member and newcomers; drains with and without abort; restart; and (integration)
ray_native engines launched and killed through a local Ray cluster."""

import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines import RolloutEngine, SamplingParams  # noqa: E402
from relax_rollout.engines.pool import EnginePool  # noqa: E402
from relax_rollout.engines.pool_members import DrainTimeout, NoActiveEngine, PoolError  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402
from relax_rollout.engines.wire import ServerError, http_json  # noqa: E402
from relax_rollout.server.served import ServedEngine  # noqa: E402
from relax_testing import SlowEngine, in_background, wait_until  # noqa: E402

EOS = 1
PROMPTS = [[3, 12, 4, 13], [7, 12, 8, 12, 9, 13], [4, 13], [5, 5, 12, 6, 13], [9, 9], [3, 4, 5], [6, 12, 7]]
GREEDY = SamplingParams(max_new_tokens=8, greedy=True)


class BrokenEngine(SlowEngine):
    def generate(self, prompts, params, on_step=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def serve(tiny_model_dir):
    """``serve(delay=0.0, broken=False) -> ServedEngine``: a fresh tiny TorchEngine on its own server."""
    started = []

    def start(delay: float = 0.0, broken: bool = False) -> ServedEngine:
        engine = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)
        if broken:
            engine = BrokenEngine(engine, 0.0)
        elif delay:
            engine = SlowEngine(engine, delay)
        s = ServedEngine(engine)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def _same_as_local(outs, local, params=GREEDY, prompts=PROMPTS):
    want = local.generate(prompts, params)
    assert len(outs) == len(prompts)
    for g, w in zip(outs, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert max(abs(a - b) for a, b in zip(g.log_probs, w.log_probs)) < 1e-5


def test_a_member_at_its_request_bound_is_asked_again_not_failed(tiny_model_dir, local):
    """A member refusing a request as busy (503 Overloaded at its --max-queued-requests bound; SGLang
    answers 429) is alive: its prompts are asked again after a pause and it is neither failed nor
    restarted (before, the 503 marked it failed and, alone in the pool, the generate failed)."""
    engine = SlowEngine(TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0), 0.3)
    served = ServedEngine(engine, max_queued_requests=1)
    pool = EnginePool([served.url])
    try:  # another client holds the one admitted request for ~2 s (8 decode steps of 0.3 s)
        held = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        holder = in_background(http_json, served.url, "/generate", held)
        wait_until(lambda: engine.versions, what="the other client's request generating")
        _same_as_local(pool.generate(PROMPTS[1:3], GREEDY), local, prompts=PROMPTS[1:3])
        holder()
        assert pool.stats()["busy_retries"] >= 2 and pool.stats()["failures"] == 0
        assert [m["state"] for m in pool.membership.members()] == ["active"]
    finally:
        pool.close()
        served.close()


def test_generate_spreads_over_members_and_equals_one_engine(serve, local):
    servers = [serve() for _ in range(3)]
    pool = EnginePool([s.url for s in servers])
    try:
        assert isinstance(pool, RolloutEngine)
        assert [m["id"] for m in pool.membership.members()] == ["e0", "e1", "e2"]
        assert all(
            m["kind"] == "startup" and m["protected"] and m["state"] == "active"
            for m in pool.membership.members()
        )
        _same_as_local(pool.generate(PROMPTS, GREEDY), local)
        served = [m["served"] for m in pool.membership.members()]
        assert served == [3, 3, 1] and pool.stats()["requests"] == 3  # contiguous chunks, one per member
        # sampled: the same lengths as one engine (min_new_tokens pins them), per-prompt minima honoured
        p = SamplingParams(max_new_tokens=9, temperature=0.8, min_new_tokens=[9, 0, 9, 0, 9, 0, 9])
        outs, ref = pool.generate(PROMPTS, p), local.generate(PROMPTS, p)
        assert [len(o.token_ids) for o in outs][::2] == [len(o.token_ids) for o in ref][::2] == [9] * 4
        assert all(len(o.log_probs) == len(o.token_ids) for o in outs)
        assert pool.generate([], GREEDY) == [] and pool.weight_version == 0
        assert pool.weights_checksum() == local.weights_checksum()
        assert pool.stats()["reissued_prompts"] == 0 and pool.stats()["failures"] == 0
    finally:
        pool.close()


def test_one_prompt_calls_go_to_the_least_loaded_members(serve, local):
    """Streaming sends one prompt a call, many at once: each goes to a member with the fewest in flight
    (they all went to the first member, leaving the others idle)."""
    from concurrent.futures import ThreadPoolExecutor

    servers = [serve(delay=0.05) for _ in range(2)]
    pool = EnginePool([s.url for s in servers])
    try:
        with ThreadPoolExecutor(8) as ex:
            outs = list(ex.map(lambda p: pool.generate([p], GREEDY)[0], PROMPTS + PROMPTS[:1]))
        _same_as_local(outs, local, prompts=PROMPTS + PROMPTS[:1])
        assert min(m["served"] for m in pool.membership.members()) >= 2  # (4 and 4 unless a call ends early)
    finally:
        pool.close()


def test_member_dying_mid_batch_has_its_prompts_reissued(serve, local):
    fast, slow = serve(), serve(delay=0.05)
    failed = []
    pool = EnginePool([fast.url, slow.url], on_failure=failed.append)
    try:
        params = SamplingParams(max_new_tokens=30, greedy=True, min_new_tokens=30)
        result = in_background(pool.generate, PROMPTS, params)
        wait_until(lambda: pool.membership.get("e1").inflight > 0)
        time.sleep(0.1)
        slow.close(abrupt=True)  # the engine process "dies": connections reset, then refused
        outs = result()
        _same_as_local(outs, local, params)  # every prompt answered, by the surviving engine
        assert all(o.finish_reason == "length" and len(o.token_ids) == 30 for o in outs)
        st = pool.stats()
        assert st["failures"] == 1 and st["reissued_prompts"] == 3 and st["engines_failed"] == 1
        e1 = pool.membership.get("e1")
        assert e1.state == "failed" and "ConnectionError" in e1.error and e1.inflight == 0
        assert [m.id for m in failed] == ["e1"]
        _same_as_local(pool.generate(PROMPTS, GREEDY), local)  # later batches go to e0 only
        assert pool.membership.get("e0").served == 7 + 7 and pool.stats()["failures"] == 1
    finally:
        pool.close()


def test_5xx_marks_member_failed_but_4xx_is_the_callers_error(serve, local):
    good, broken = serve(), serve(broken=True)
    pool = EnginePool([good.url, broken.url])
    try:
        _same_as_local(pool.generate(PROMPTS, GREEDY), local)
        assert pool.membership.get("e1").state == "failed" and "HTTP 500" in pool.membership.get("e1").error
        assert "illegal memory access" in pool.membership.get("e1").error
        with pytest.raises(ServerError, match="max_new_tokens") as e:
            pool.generate(PROMPTS[:1], SamplingParams(max_new_tokens=-1))
        assert e.value.status == 400 and pool.membership.get("e0").state == "active"  # not the engine's fault
    finally:
        pool.close()


def test_no_active_engine_left_raises_and_says_why(serve):
    a, b = serve(), serve()
    pool = EnginePool([a.url, b.url])
    try:
        pool.membership.remove("e0")
        with pytest.raises(PoolError, match="last active engine"):
            pool.membership.remove("e1")
        assert pool.membership.get("e0").state == "removed" and pool.membership.get("e1").state == "active"
        b.close(abrupt=True)
        with pytest.raises(NoActiveEngine, match=r"e0 removed; e1 failed \(ConnectionError"):
            pool.generate(PROMPTS, GREEDY)
    finally:
        pool.close()


def test_update_weights_reaches_members_and_newcomers(serve, local):
    a, b = serve(), serve()
    failed = []
    pool = EnginePool([a.url, b.url], on_failure=failed.append)
    try:
        before = pool.weights_checksum()
        g = torch.Generator().manual_seed(7)
        new = {
            n: torch.randn(w.shape, generator=g) for n, w in local.named_weights() if n.startswith("lm_head")
        }
        pool.update_weights(new, 5)
        assert pool.weight_version == 5 and pool.weights_checksum() != before
        pauses = pool.pauses.drain()  # each member's load, timed as its pause (#53)
        assert [v for v, _ in pauses] == [5, 5] and all(s > 0 for _, s in pauses)
        for s in (a, b):
            assert http_json(s.url, "/get_model_info")["weight_version"] == "5"
        kept = [p.name for p in Path(pool.weights_root).iterdir()]
        assert (
            len(kept) == 1
            and kept[0].startswith("v5-")
            and Path(pool.weights_path, "model.safetensors").exists()
        )
        # a newcomer (fresh weights, version 0) gets the current weights before it serves
        c = serve()
        assert http_json(c.url, "/get_model_info")["weight_version"] == "0"
        m = pool.membership.add(c.url)
        assert (m.id, m.kind, m.protected, m.state, m.weight_version) == (
            "e2",
            "external",
            False,
            "active",
            5,
        )
        assert http_json(c.url, "/get_model_info")["weight_version"] == "5"
        sums = {http_json(s.url, "/weights_checksum")["checksum"] for s in (a, b, c)}
        assert sums == {pool.weights_checksum()}
        assert {o.weight_version for o in pool.generate(PROMPTS, GREEDY)} == {5}
        # the next version replaces the kept one; a dead member is marked failed, the update goes on
        pool.update_weights(new, 6)
        assert [p.name[:3] for p in Path(pool.weights_root).iterdir()] == ["v6-"]
        b.close(abrupt=True)
        pool.update_weights(new, 7)
        assert (
            pool.weight_version == 7
            and pool.membership.get("e1").state == "failed"
            and [x.id for x in failed] == ["e1"]
        )
        assert {http_json(s.url, "/get_model_info")["weight_version"] for s in (a, c)} == {"7"}
        # weights that do not fit the model: every server refuses (400, as SGLang answers a failed load,
        # whose weights may then be half-loaded): they are failed, the error names each, the version stays
        with pytest.raises(PoolError, match=r"no engine loaded weight version 8: e0 .*not\.a\.weight.*; e2 "):
            pool.update_weights({"not.a.weight": torch.zeros(1)}, 8)
        assert pool.weight_version == 7 and [p.name[:3] for p in Path(pool.weights_root).iterdir()] == ["v7-"]
        assert {pool.membership.get(i).state for i in ("e0", "e2")} == {"failed"}
    finally:
        pool.close()
    assert not Path(pool.weights_root).exists()


def test_an_update_sglang_refuses_only_for_its_cache_flush_is_sent_again(flush_refusing_sglang):
    """SGLang refuses a disk update it has loaded when its cache flush meets requests that just ended (see
    ``flush_refusing_sglang``): the pool sends it again rather than failing the engine (which restarted it:
    before, this member was failed and, alone, the update raised). ``flush_cache=False`` (requests paused
    in place) goes on the wire; a refusal for another reason still fails the member at once."""
    sglang = flush_refusing_sglang(refusals=2)
    failed = []
    pool = EnginePool([sglang.url], on_failure=failed.append)
    try:
        pool.update_weights({"w": torch.zeros(2)}, 3)
        assert pool.weight_version == 3 and sglang.version == "3" and not failed
        assert len(sglang.bodies) == 3 and all(b["flush_cache"] for b in sglang.bodies)
        pool.update_weights({"w": torch.ones(2)}, 4, flush_cache=False)
        assert sglang.bodies[-1]["flush_cache"] is False and sglang.version == "4"
    finally:
        pool.close()


def test_add_checks_the_url_and_reachability(serve):
    a = serve()
    pool = EnginePool([a.url], join_timeout_s=0.5)
    try:
        with pytest.raises(PoolError, match="http:// or https://"):
            pool.membership.add("ftp://127.0.0.1:1")
        with pytest.raises(PoolError, match="already in the pool as e0"):
            pool.membership.add(a.url + "/")
        b = serve()
        pool.membership.add(b.url)
        pool.membership.get("e1").state = "failed"  # as after a crash; the engine at that URL is back
        m = pool.membership.add(b.url)
        assert (
            m.id == "e2"
            and pool.membership.get("e1").state == "removed"
            and pool.membership.get("e1").replaced_by == "e2"
        )
        from relax_core.net import free_port

        with pytest.raises(PoolError, match="could not join"):
            pool.membership.add(f"http://127.0.0.1:{free_port()}")
        gone = pool.membership.members(include_removed=True)[-1]
        assert gone["state"] == "removed" and "join failed" in gone["error"]
        assert [m["id"] for m in pool.membership.members()] == ["e0", "e2"]
    finally:
        pool.close()


def test_remove_waits_for_in_flight_requests(serve, local):
    fast, slow = serve(), serve(delay=0.02)
    removed, killed = [], []
    pool = EnginePool([fast.url], kill=killed.append, on_removed=removed.append)
    try:
        pool.membership.add(slow.url, "ray_native", handle="actor-1")
        params = SamplingParams(max_new_tokens=20, greedy=True, min_new_tokens=20)
        result = in_background(pool.generate, PROMPTS, params)
        wait_until(lambda: pool.membership.get("e1").inflight > 0)
        t0 = time.monotonic()
        m = pool.membership.remove("e1", drain_timeout_s=20.0)
        assert time.monotonic() - t0 > 0.1  # it waited for the slow engine's requests
        _same_as_local(result(), local, params)
        assert m.state == "removed" and m.served == 3 and pool.stats()["reissued_prompts"] == 0
        assert killed == ["actor-1"] and [x.id for x in removed] == ["e1"]
        assert [x["id"] for x in pool.membership.members()] == ["e0"]
        with pytest.raises(PoolError, match="already removed"):
            pool.membership.remove("e1")
    finally:
        pool.close()


def test_remove_aborts_after_the_drain_timeout_and_reissues(serve, local):
    fast, slow = serve(), serve(delay=0.05)
    pool = EnginePool([fast.url])
    try:
        pool.membership.add(slow.url)
        params = SamplingParams(max_new_tokens=40, greedy=True, min_new_tokens=40)
        # without force: the drain times out, the member is active again
        result = in_background(pool.generate, PROMPTS, params)
        wait_until(lambda: pool.membership.get("e1").inflight > 0)
        with pytest.raises(DrainTimeout, match="active again"):
            pool.membership.remove("e1", drain_timeout_s=0.1, force=False)
        assert pool.membership.get("e1").state == "active"
        _same_as_local(result(), local, params)
        # with force: aborted on e1, re-issued on e0, every prompt answered in full
        result = in_background(pool.generate, PROMPTS, params)
        wait_until(lambda: pool.membership.get("e1").inflight > 0)
        pool.membership.remove("e1", drain_timeout_s=0.1, force=True)
        outs = result()
        _same_as_local(outs, local, params)
        assert all(o.finish_reason == "length" for o in outs)
        st = pool.stats()
        assert st["aborts_reissued"] == 3 and st["reissued_prompts"] == 3 and st["failures"] == 0
        assert pool.membership.get("e1").state == "removed"
    finally:
        pool.close()


def test_restart_replaces_a_failed_member_with_current_weights(serve, local):
    handles: list[ServedEngine] = []
    killed = []

    def launch():
        s = serve()
        handles.append(s)
        return s.url, s

    def kill(s):
        killed.append(s)
        s.close()

    pool = EnginePool(launch=launch, kill=kill)
    try:
        pool.membership.start(2)
        assert (
            sorted((m["kind"], m["protected"]) for m in pool.membership.members()) == [("startup", True)] * 2
        )
        new = {n: w.detach() * 1.5 for n, w in local.named_weights() if n.startswith("lm_head")}
        pool.update_weights(new, 3)
        victim = pool.membership.active()[1]
        victim.handle.close(abrupt=True)
        assert len(pool.generate(PROMPTS, GREEDY)) == len(PROMPTS) and victim.state == "failed"
        m = pool.membership.restart(victim.id)
        assert (m.id, m.kind, m.protected, m.state, m.weight_version) == ("e2", "startup", True, "active", 3)
        assert victim.state == "removed" and victim.replaced_by == "e2" and killed == [victim.handle]
        assert http_json(m.url, "/get_model_info")["weight_version"] == "3"
        assert len({http_json(x.url, "/weights_checksum")["checksum"] for x in pool.membership.active()}) == 1
        with pytest.raises(PoolError, match="external"):
            pool.membership.restart(pool.membership.add(serve().url).id)
    finally:
        pool.close()


@pytest.fixture(scope="module")
def ray_cluster():
    os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"  # under `uv run`, workers reuse this venv as is
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.mark.integration
@pytest.mark.slow
def test_ray_native_engines_launch_fail_restart_and_kill(ray_cluster, tiny_model_dir, local):
    from relax_rollout.server.served import ray_launcher

    ray = ray_cluster
    launch, kill = ray_launcher(tiny_model_dir, "float32", torch_threads=1, num_cpus=0.1)
    pool = EnginePool(launch=launch, kill=kill)
    try:
        a, b = pool.membership.start(2)
        pids = [ray.get(m.handle.pid.remote()) for m in (a, b)]
        assert len(set(pids)) == 2 and os.getpid() not in pids  # each engine is its own process
        _same_as_local(pool.generate(PROMPTS, GREEDY), local)
        ray.kill(b.handle, no_restart=True)  # the engine process dies behind the pool's back
        _same_as_local(pool.generate(PROMPTS, GREEDY), local)
        assert b.state == "failed" and pool.stats()["failures"] == 1 and pool.stats()["reissued_prompts"] >= 1
        c = pool.membership.restart(b.id)
        assert c.kind == "startup" and c.protected and ray.get(c.handle.pid.remote()) not in pids
        _same_as_local(pool.generate(PROMPTS, GREEDY), local)
        pool.membership.remove(c.id, drain_timeout_s=5.0)  # kills its process
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(c.handle.pid.remote(), timeout=30)
        assert [m["id"] for m in pool.membership.members()] == [a.id] and pool.membership.get(
            b.id
        ).replaced_by == c.id
    finally:
        pool.close(kill=True)


def test_member_spans_give_each_engine_a_timeline_row_from_joining_to_leaving():
    """#56: every state a member entered is timed (whoever set it), and becomes a span on its own row."""
    from relax_rollout.engines.pool_members import Member, member_spans

    gone, kept = Member("e1", "http://a:1", "external"), Member("e2", "http://a:2", "ray_native", node="n2")
    for state in ("active", "draining", "removed"):
        gone.state = state
    kept.state = "active"
    kept.state = "active"  # (no change, no new span)
    spans = member_spans([gone, kept], now=kept.changes[-1][0] + 5.0)
    rows = [(s["role"], s["name"]) for s in spans]
    assert rows == [
        ("engine e1", "engine joining"),
        ("engine e1", "engine active"),
        ("engine e1", "engine draining"),
        ("engine e2", "engine joining"),
        ("engine e2", "engine active"),
    ]
    assert spans[-1]["dur_ns"] >= 5e9 and spans[-1]["args"] == {
        "kind": "ray_native",
        "url": "http://a:2",
        "node": "n2",
    }
    draining = spans[2]  # (ends when it was removed)
    assert abs((draining["start_ns"] + draining["dur_ns"]) / 1e9 - gone.changes[-1][0]) < 1e-3
