"""``remote`` against a real HTTP server on 127.0.0.1: replies, retries, give-up, Scorer fallback."""

import socket

import pytest

from relax_rewards import Scorer, get_reward
from relax_rewards._http import HTTPRewardError
from relax_rewards.remote import RemoteReward


def test_posts_sample_and_reads_score(http_server):
    http_server.routes["/score"] = lambda body: (200, {"score": 0.75, "why": "close"})
    r = get_reward("remote")("resp", "gold", {"remote_url": http_server.url + "/score", "id": 3})
    assert r.score == 0.75 and r.details == {"why": "close"}
    path, body, headers = http_server.requests[0]
    assert body == {"response": "resp", "label": "gold", "metadata": {"id": 3}}
    assert headers["Content-Type"] == "application/json"


def test_bare_number_reply(http_server):
    http_server.routes["/score"] = lambda body: (200, 1)
    assert RemoteReward(http_server.url + "/score")("a", "b").score == 1.0


def test_retries_until_the_server_recovers(http_server):
    calls = {"n": 0}

    def flaky(body):
        calls["n"] += 1
        return (503, {"error": "busy"}) if calls["n"] <= 2 else (200, {"score": 1.0})

    http_server.routes["/score"] = flaky
    r = RemoteReward(http_server.url + "/score", retries=3, backoff_s=0.01)("a", "b")
    assert r.score == 1.0 and calls["n"] == 3


def test_gives_up_after_retries_and_scorer_falls_back(http_server):
    http_server.routes["/score"] = lambda body: (500, {"error": "down"})
    reward = RemoteReward(http_server.url + "/score", retries=2, backoff_s=0.01)
    with pytest.raises(HTTPRewardError, match="gave up after 3 attempts"):
        reward("a", "b")
    assert len(http_server.requests) == 3
    result = Scorer(reward, fallback_score=-1.0).score("a", "b")
    assert result.score == -1.0 and "HTTPRewardError" in result.failure


def test_client_errors_are_not_retried(http_server):
    http_server.routes["/score"] = lambda body: (400, {"error": "bad request"})
    with pytest.raises(HTTPRewardError, match="HTTP 400"):
        RemoteReward(http_server.url + "/score", retries=5, backoff_s=0.01)("a", "b")
    assert len(http_server.requests) == 1


def test_connection_refused_is_retried_then_fails():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(HTTPRewardError, match="cannot reach"):
        RemoteReward(f"http://127.0.0.1:{port}/score", retries=1, backoff_s=0.01, timeout_s=1)("a", "b")


def test_missing_url_is_an_error(monkeypatch):
    monkeypatch.delenv("RELAX_REMOTE_RM_URL", raising=False)
    with pytest.raises(ValueError, match="remote_url"):
        get_reward("remote")("a", "b", {})


def test_env_url_and_batch_through_scorer(http_server, monkeypatch):
    http_server.routes["/s"] = lambda body: (200, {"score": float(body["response"] == body["label"])})
    monkeypatch.setenv("RELAX_REMOTE_RM_URL", http_server.url + "/s")
    results = Scorer("remote", max_concurrency=4).score_batch(["a", "b", "c"], ["a", "x", "c"])
    assert [r.score for r in results] == [1.0, 0.0, 1.0]


def test_async_batch_form(http_server):
    import asyncio

    http_server.routes["/s"] = lambda body: (200, {"score": len(body["response"])})
    reward = RemoteReward(http_server.url + "/s", retries=0)
    results = asyncio.run(reward.ascore_batch(["a", "bb", "ccc"], [None] * 3, concurrency=2))
    assert [r.score for r in results] == [1.0, 2.0, 3.0]
