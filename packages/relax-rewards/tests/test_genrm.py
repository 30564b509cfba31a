"""``genrm`` against real OpenAI-style and SGLang-style HTTP servers on 127.0.0.1."""

import pytest

from relax_rewards import Scorer, get_reward
from relax_rewards.genrm import GenRM


def chat_reply(text):
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]}


def judge(body):
    prompt = body["messages"][-1]["content"]
    verdict = "CORRECT" if "Student response: 42" in prompt else "INCORRECT"
    return 200, chat_reply(f"Reasoning...\nVerdict: {verdict}")


def test_openai_endpoint(http_server):
    http_server.routes["/v1/chat/completions"] = judge
    rm = GenRM(http_server.url, model="judge-7b", api_key="sk-test", system_prompt="Be strict.")
    ok = rm("42", "42", {"question": "6*7?"})
    assert ok.score == 1.0 and ok.details["verdict_found"]
    assert rm("41", "42").score == 0.0
    _, body, headers = http_server.requests[0]
    assert body["model"] == "judge-7b" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "Be strict."}
    assert "Question: 6*7?" in body["messages"][1]["content"]
    assert headers["Authorization"] == "Bearer sk-test"


def test_sglang_generate_endpoint_and_numeric_scale(http_server):
    http_server.routes["/generate"] = lambda body: (200, {"text": "Score: 8", "meta_info": {}})
    rm = GenRM(
        http_server.url, api="sglang", verdict_pattern=r"Score:\s*(\d+)", score_scale=10, max_tokens=16
    )
    assert rm("x", "y").score == pytest.approx(0.8)
    _, body, _ = http_server.requests[0]
    assert body["sampling_params"] == {"max_new_tokens": 16, "temperature": 0.0} and "text" in body


def test_custom_template(http_server):
    http_server.routes["/v1/chat/completions"] = lambda body: (200, chat_reply("Verdict: yes"))
    rm = GenRM(http_server.url + "/v1", template="Q={question} R={response} L={label}")
    assert rm("r", "l", {"question": "q"}).score == 1.0
    assert http_server.requests[0][1]["messages"][0]["content"] == "Q=q R=r L=l"


def test_no_verdict_raises_or_uses_unparsed_score(http_server):
    http_server.routes["/v1/chat/completions"] = lambda body: (200, chat_reply("I cannot decide."))
    with pytest.raises(ValueError, match="no verdict"):
        GenRM(http_server.url)("r", "l")
    assert GenRM(http_server.url, unparsed_score=0.5)("r", "l").score == 0.5
    result = Scorer(GenRM(http_server.url)).score("r", "l")
    assert result.failure.startswith("raised ValueError") and result.score == 0.0


def test_retries_on_server_errors(http_server):
    calls = {"n": 0}

    def flaky(body):
        calls["n"] += 1
        return (502, {}) if calls["n"] == 1 else (200, chat_reply("Verdict: CORRECT"))

    http_server.routes["/v1/chat/completions"] = flaky
    assert GenRM(http_server.url, backoff_s=0.01)("r", "l").score == 1.0 and calls["n"] == 2


def test_registered_genrm_reads_metadata_config(http_server):
    http_server.routes["/generate"] = lambda body: (200, [{"text": "Verdict: CORRECT"}])
    meta = {"genrm": {"base_url": http_server.url, "api": "sglang"}}
    results = Scorer("genrm", max_concurrency=2).score_batch(["a", "b"], ["a", "b"], [meta, meta])
    assert [r.score for r in results] == [1.0, 1.0]
    with pytest.raises(ValueError, match="unknown genrm settings"):
        get_reward("genrm")("a", "b", {"genrm": {"base_url": "http://x", "temprature": 1}})


def test_bad_api_name():
    with pytest.raises(ValueError, match="openai"):
        GenRM("http://x", api="tgi")
