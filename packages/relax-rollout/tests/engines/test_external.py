"""ExternalEngine against a served TorchEngine: the same engine contract as the in-process engine
(greedy tokens and log-probs, seeded sampling, stop/length, per-prompt min_new_tokens, weight updates
with versions and checksums), several servers, retries, and the config wiring."""

import threading

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines import ENGINES, RolloutEngine, SamplingParams, build_engine  # noqa: E402
from relax_rollout.engines.external import ExternalEngine, ServerError  # noqa: E402

pytestmark = pytest.mark.integration
PROMPTS = [[3, 12, 4, 13], [7, 12, 8, 12, 9, 13], [4, 13], [5, 5, 12, 6, 13]]


@pytest.fixture(scope="module")
def ext(engine_server):
    return build_engine("external", urls=[engine_server], model_path="ignored")


def test_registered_and_protocol(ext):
    assert ENGINES["external"].endswith("external:ExternalEngine")
    assert isinstance(ext, RolloutEngine)
    with pytest.raises(ValueError, match="rollout-external-urls"):
        ExternalEngine(urls=[])


def test_greedy_tokens_and_log_probs_equal_in_process_engine(ext, local):
    p = SamplingParams(max_new_tokens=12, greedy=True)
    got, want = ext.generate(PROMPTS, p), local.generate(PROMPTS, p)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        assert max(abs(a - b) for a, b in zip(g.log_probs, w.log_probs)) < 1e-5
        assert len(g.log_probs) == len(g.token_ids)
    assert ext.generate([], p) == []


def test_seeded_sampling_reproducible_and_equal_to_local(ext, local):
    p = SamplingParams(max_new_tokens=8, seed=11, temperature=0.7)
    a = ext.generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in ext.generate(PROMPTS, p)]
    assert [o.token_ids for o in a] == [o.token_ids for o in local.generate(PROMPTS, p)]


def test_stop_length_and_per_prompt_min_new_tokens(ext, local):
    first = local.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, greedy=True))[0].token_ids[0]
    out = ext.generate([PROMPTS[0]], SamplingParams(max_new_tokens=5, greedy=True, stop_token_ids=(first,)))[
        0
    ]
    assert out.token_ids == [first] and out.finish_reason == "stop"
    p = SamplingParams(max_new_tokens=6, greedy=True, min_new_tokens=[0, 6, 2, 6])
    got = ext.generate(PROMPTS, p)
    assert [o.token_ids for o in got] == [o.token_ids for o in local.generate(PROMPTS, p)]
    assert got[1].finish_reason == "length" and len(got[1].token_ids) == 6


def test_top_logprobs_and_stop_strings_pass_through_to_the_server(ext, local):
    """SGLang's ``top_logprobs_num`` and ``sampling_params.stop`` are sent, and read back into the output."""
    p = SamplingParams(max_new_tokens=8, greedy=True, min_new_tokens=8, top_logprobs=2)
    want = local.generate(PROMPTS, p)
    got = ext.generate(PROMPTS, p)
    for g, w in zip(got, want):
        assert [[t for t, _ in row] for row in g.top_logprobs] == [
            [t for t, _ in row] for row in w.top_logprobs
        ]
    stop = local.tokenizer.decode(want[0].token_ids[-2:])
    got = ext.generate(PROMPTS, SamplingParams(**{**p.__dict__, "stop": (stop,)}))
    want = local.generate(PROMPTS, SamplingParams(**{**p.__dict__, "stop": (stop,)}))
    assert got[0].matched_stop == stop and got[0].finish_reason == "stop"
    assert [(o.token_ids, o.matched_stop) for o in got] == [(o.token_ids, o.matched_stop) for o in want]


def test_update_weights_changes_outputs_version_and_checksum(ext, local, tiny_model_dir):
    p = SamplingParams(max_new_tokens=6, greedy=True)
    before, v0, sum0 = ext.generate(PROMPTS, p), ext.weight_version, ext.weights_checksum()
    assert sum0 == local.weights_checksum()
    g = torch.Generator().manual_seed(123)
    new = {n: torch.randn(w.shape, generator=g) for n, w in local.named_weights() if n.startswith("lm_head")}
    ext.update_weights(new, v0 + 3)
    after = ext.generate(PROMPTS, p)
    assert ext.weight_version == v0 + 3 and all(o.weight_version == v0 + 3 for o in after)
    assert ext.weights_checksum() != sum0
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    with pytest.raises(ServerError, match="not.a.weight"):
        ext.update_weights({"not.a.weight": torch.zeros(1)}, v0 + 4)
    ext.update_weights(dict(local.named_weights()), v0 + 4)  # restore
    assert ext.weights_checksum() == sum0 and ext.weight_version == v0 + 4


def test_two_servers_split_the_batch(engine_server, local, tiny_model_dir):
    from relax_rollout.server import EngineServer, make_server

    httpd = make_server(EngineServer(local), "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        two = ExternalEngine(urls=[engine_server, f"http://127.0.0.1:{httpd.server_address[1]}"])
        p = SamplingParams(max_new_tokens=6, greedy=True)
        assert [o.token_ids for o in two.generate(PROMPTS, p)] == [
            o.token_ids for o in local.generate(PROMPTS, p)
        ]
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_connection_errors_are_retried_then_raised():
    from relax_core.net import free_port

    eng = ExternalEngine(urls=[f"http://127.0.0.1:{free_port()}"], retries=2, retry_backoff_s=0.01)
    with pytest.raises(ConnectionError, match="after 3 tries"):
        eng.generate([[3, 4]], SamplingParams(max_new_tokens=1))
    assert eng.health() == [False]


def test_config_field_and_validation():
    from pydantic import ValidationError

    from relax_core.config_sections import RolloutConfig

    cfg = RolloutConfig(rollout_backend="external", rollout_external_urls=["http://127.0.0.1:30000"])
    assert cfg.rollout_external_urls == ["http://127.0.0.1:30000"]
    assert RolloutConfig().rollout_external_urls == []
    with pytest.raises(ValidationError, match="rollout-external-urls"):
        RolloutConfig(rollout_backend="external")


def test_updates_go_in_across_a_refused_cache_flush_and_without_a_flush_when_paused_in_place(
    flush_refusing_sglang, caplog
):
    """SGLang servers launched by the user: a disk update refused only for its cache flush (requests that
    just ended, see ``flush_refusing_sglang``) is sent again, and under an in-place pause (partial rollout)
    the update asks for no flush, which SGLang refuses while the paused requests hold its cache."""
    sglang = flush_refusing_sglang(refusals=1)
    ext = ExternalEngine(urls=[sglang.url])
    ext.update_weights({"w": torch.zeros(2)}, 1)
    assert sglang.version == "1" and [b["flush_cache"] for b in sglang.bodies] == [True, True]
    ext.pause("in_place")
    ext.update_weights({"w": torch.ones(2)}, 2)
    ext.resume()
    ext.update_weights({"w": torch.ones(2)}, 3)
    assert [b["flush_cache"] for b in sglang.bodies[2:]] == [False, True] and ext.weight_version == 3
    # its launch flags (the field names are real SGLang's, test_sglang_real*.py): the overlap scheduler on
    # only warns (a boundary token stamped one version late)
    ext.check_partial_rollout()
    assert "--disable-overlap-schedule" in caplog.text


def test_our_engine_server_passes_the_partial_rollout_check(ext):
    ext.check_partial_rollout()  # (no prefix cache, no launch flags to read)


def test_a_server_at_its_request_bound_is_asked_again(tiny_model_dir, local):
    """A server refusing a request as busy (our engine server's 503 Overloaded; SGLang's 503 "The request
    queue is full.", test_sglang_real.py) is asked again after a pause, as the engine pool does; the
    external engine raised the 503."""
    from relax_rollout.engines.torch_engine import TorchEngine
    from relax_rollout.engines.wire import http_json
    from relax_rollout.server.served import ServedEngine
    from relax_testing import SlowEngine, in_background, wait_until

    engine = SlowEngine(TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0), 0.3)
    served = ServedEngine(engine, max_queued_requests=1)
    try:  # another client holds the one admitted request for ~2 s (8 decode steps of 0.3 s)
        held = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        holder = in_background(http_json, served.url, "/generate", held)
        wait_until(lambda: engine.versions, what="the other client's request generating")
        p = SamplingParams(max_new_tokens=4, greedy=True)
        got, want = (
            ExternalEngine(urls=[served.url]).generate(PROMPTS[1:2], p),
            local.generate(PROMPTS[1:2], p),
        )
        assert got[0].token_ids == want[0].token_ids
        holder()
        assert served.state.metrics.refused >= 1
    finally:
        served.close()


def test_one_prompt_calls_go_to_the_least_loaded_servers_at_once(engine_server, tiny_model_dir, local):
    """Streaming sends one prompt a call, many at once: each goes to the server with the fewest in flight,
    and calls are not queued behind one another (they all went to the first server, two at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    from relax_rollout.engines.torch_engine import TorchEngine
    from relax_rollout.server.served import ServedEngine
    from relax_testing import SlowEngine

    served = [
        ServedEngine(
            SlowEngine(TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0), 0.05)
        )
        for _ in range(2)
    ]
    try:
        ext = ExternalEngine(urls=[s.url for s in served])
        p = SamplingParams(max_new_tokens=4, greedy=True)
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda q: ext.generate([q], p)[0], PROMPTS * 2))
        assert [g.token_ids for g in got] == [w.token_ids for w in local.generate(PROMPTS * 2, p)]
        assert min(s.state.metrics.requests for s in served) >= 2  # (4 and 4 unless a call ends early)
    finally:
        for s in served:
            s.close()
