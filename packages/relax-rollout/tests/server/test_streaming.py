"""Token-by-token streaming through the engine server: chat, completions and SGLang's ``/generate`` send
each token as it is sampled (they sent one event once the whole reply was generated), ``n`` choices
interleave, and a client that disconnects ends its request.

The engine below holds its generation after the first token until the test says go: a stream whose first
chunk reaches the client while the engine waits there was sent before the last token was generated — an
order, not a timing. The wait has a bound only so that a server that does not stream fails the test
instead of hanging it."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from relax_rollout.engines.torch_engine import TorchEngine

HOLD_S = 60.0
ASK = {"model": "default", "messages": [{"role": "user", "content": "1+2="}], "temperature": 0}


class HeldEngine(TorchEngine):
    """A TorchEngine that, once armed, stops after handing over its first token until ``go`` is set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.armed, self.go, self.held = False, threading.Event(), None

    def arm(self) -> None:
        self.armed, self.held = True, None
        self.go.clear()

    def generate(self, prompts, params, on_step=None, mm=None, on_token=None):
        if on_token is not None and self.armed:
            self.armed, passed, waited = False, on_token, []

            def on_token(d):
                passed(d)
                if not waited:
                    waited.append(d)
                    self.held = self.go.wait(HOLD_S)  # True: released by the test, not by the bound

        return super().generate(prompts, params, on_step=on_step, mm=mm, on_token=on_token)


@pytest.fixture(scope="module")
def held(tiny_model_dir):
    """(engine, server state, base URL): a :class:`HeldEngine` served in this process."""
    from transformers import AutoTokenizer

    from relax_rollout.server import EngineServer, make_server

    engine = HeldEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0)
    state = EngineServer(
        engine, AutoTokenizer.from_pretrained(tiny_model_dir), served_model_name='tiny "q\\w"'
    )
    httpd = make_server(state, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield engine, state, f"http://127.0.0.1:{httpd.server_address[1]}"
    engine.go.set()
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def client(held):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{held[2]}/v1", api_key="x", max_retries=0)


def _read_held(engine, stream, has_text) -> list:
    """Every chunk of ``stream``; the engine is let go once a chunk with text came (while it was held)."""
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if not engine.go.is_set() and has_text(chunk):
            engine.go.set()
    return chunks


def test_a_streamed_chat_arrives_token_by_token(held, client):
    engine, _, _ = held
    ask = {**ASK, "max_tokens": 12, "extra_body": {"min_tokens": 12}}
    whole = client.chat.completions.create(**ask)
    engine.arm()
    stream = client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    chunks = _read_held(engine, stream, lambda c: c.choices and c.choices[0].delta.content)
    assert engine.held is True  # the first chunk came while the engine held its second token
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(texts) >= 6, texts  # (12 one-character tokens: held back only where a mark could begin)
    assert "".join(texts) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [f.finish_reason for f in finish] == [whole.choices[0].finish_reason] == ["length"]
    assert (
        chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12 and not chunks[-1].choices
    )
    # log-probs per chunk: together, every token's, as the whole reply lists them
    lp = client.chat.completions.create(**ask, stream=True, logprobs=True)
    got = [
        e.logprob for c in lp if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    want = client.chat.completions.create(**ask, logprobs=True).choices[0].logprobs.content
    assert got == pytest.approx([e.logprob for e in want])


def test_a_streamed_completion_arrives_token_by_token(held, client):
    engine, _, _ = held
    ask = {"model": "default", "prompt": "1+2=", "max_tokens": 10, "temperature": 0, "logprobs": 1}
    whole = client.completions.create(**ask)
    engine.arm()
    chunks = _read_held(engine, client.completions.create(**ask, stream=True), lambda c: c.choices[0].text)
    assert engine.held is True
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert len(texts) >= 5 and "".join(texts) == whole.choices[0].text
    lps = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert lps == pytest.approx(whole.choices[0].logprobs.token_logprobs)
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == whole.choices[0].logprobs.text_offset
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_choices_stream_interleaved_by_index(held, client):
    """``n`` choices sampled together stream together (choices with seeds of their own are sampled, and
    streamed, one after another)."""
    ask = {**ASK, "max_tokens": 8, "n": 2, "extra_body": {"min_tokens": 8}}
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    order = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.content]
    assert order != sorted(order)  # both choices' tokens come as they are sampled, not one after the other
    assert [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason] == [0, 1]
    for choice in whole.choices:
        text = "".join(
            c.choices[0].delta.content or ""
            for c in chunks
            if c.choices and c.choices[0].index == choice.index
        )
        assert text == choice.message.content


def test_a_stop_string_is_never_streamed(held, client, call):
    """Text that could begin a stop string waits; the stream stops where the whole reply is cut."""
    ask = {**ASK, "max_tokens": 12, "extra_body": {"min_tokens": 12}}
    text = client.chat.completions.create(**ask).choices[0].message.content
    for stop in (text[3:6], text[-2:]):
        cut = client.chat.completions.create(**ask, stop=[stop]).choices[0].message.content
        streamed = client.chat.completions.create(**ask, stop=[stop], stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut
        assert cut == text[: text.find(stop)]


def _sse(url: str, path: str, body: dict) -> list[dict]:
    req = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    events = []
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_sglang_generate_streams_the_reply_so_far_at_each_token(held, call):
    _, _, url = held
    body = {"text": "1+2=", "sampling_params": {"max_new_tokens": 6, "min_new_tokens": 6, "temperature": 0}}
    _, whole = call(url, "/generate", {**body, "return_logprob": True})
    events = _sse(url, "/generate", {**body, "stream": True, "return_logprob": True})
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4, 5, 6, 6]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None] * 6
    assert events[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert all(whole["text"].startswith(e["text"]) for e in events)
    assert events[-2]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    # a batch: each prompt's chunks carry its index, interleaved as sampled
    batch = _sse(url, "/generate", {**body, "text": ["1+2=", "3+4="], "stream": True})
    assert {e["index"] for e in batch} == {0, 1}
    assert [e["index"] for e in batch] != sorted(e["index"] for e in batch)


def test_a_client_that_disconnects_ends_its_request(held):
    """The engine holds after the first token; the client reads it and leaves; the server aborts the
    request (the engine stops at its next step, its row freed), as /abort_request would."""
    import http.client

    engine, state, url = held
    before = _metrics(url)
    engine.arm()
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"text": "1+2=", "sampling_params": {"max_new_tokens": 100, "min_new_tokens": 100}, "stream": True}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")  # the first token's chunk
    conn.sock.close()  # the client leaves mid-stream
    conn.close()
    deadline = time.monotonic() + HOLD_S
    while not any(r.aborted for r in list(state._reqs.values())):  # the server saw it leave
        assert time.monotonic() < deadline, "the disconnect did not abort the request"
        time.sleep(0.02)
    engine.go.set()
    while state._reqs:  # the engine ended it at its next step: no request left in flight
        assert time.monotonic() < deadline, "the aborted request did not end"
        time.sleep(0.02)
    after = _metrics(url)
    assert (
        after["sglang:num_aborted_requests_total"] - before.get("sglang:num_aborted_requests_total", 0) == 1
    )
    made = after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"]
    assert 1 <= made < 100
    assert after["sglang:num_running_reqs"] == 0


def _metrics(url: str, accept: str | None = None) -> dict[str, float]:
    """``/metrics`` through prometheus_client's parser: sample name -> value summed over label sets."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
    from prometheus_client.parser import text_string_to_metric_families as text

    req = urllib.request.Request(url + "/metrics", headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(req, timeout=30) as r:
        body, kind = r.read().decode(), r.headers["Content-Type"]
    parse = openmetrics if kind.startswith("application/openmetrics-text") else text
    out: dict[str, float] = {}
    for family in parse(body):
        for s in family.samples:
            key = s.name + (f"[{s.labels['le']}]" if "le" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


SGLANG_NAMES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
    "sglang:queue_time_seconds_count",
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:num_requests_total",
    "sglang:num_aborted_requests_total",
    "sglang:time_to_first_token_seconds_count",
    "sglang:inter_token_latency_seconds_count",
    "sglang:e2e_request_latency_seconds_count",
    "relax:num_refused_requests_total",
    "relax:weight_version",
)


def test_metrics_parse_as_openmetrics_and_text_and_count_the_requests(held, client):
    """Both of prometheus_client's parsers read ``/metrics`` (OpenMetrics when asked, as Prometheus asks);
    SGLang's names are there, the model name label escaped, and the counts follow the requests made."""
    _, _, url = held
    before = _metrics(url)
    ask = {**ASK, "max_tokens": 5, "extra_body": {"min_tokens": 5}}
    client.chat.completions.create(**ask)
    list(client.chat.completions.create(**ask, stream=True))
    client.completions.create(
        model="default", prompt="1+2=", max_tokens=4, temperature=0, n=2, extra_body={"min_tokens": 4}
    )
    openmetrics = _metrics(url, "application/openmetrics-text; version=1.0.0")
    after = _metrics(url)
    for name in SGLANG_NAMES:
        assert name in after, name
    om_name = {n.removesuffix("_total") if n.endswith("_total") else n for n in SGLANG_NAMES}
    assert all(any(k.startswith(n) for k in openmetrics) for n in om_name)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("sglang:num_requests_total") == 4  # 1 + 1 chats, 2 completion choices
    assert grew("sglang:generation_tokens_total") == 5 + 5 + 8
    assert grew("sglang:time_to_first_token_seconds_count") == 4  # one first token per response
    assert grew("sglang:inter_token_latency_seconds_count") == (5 - 1) * 2 + (4 - 1) * 2  # every later token
    assert grew("sglang:e2e_request_latency_seconds_count") == 4
    assert grew("sglang:queue_time_seconds_count") == 4
    assert (
        after["sglang:inter_token_latency_seconds_bucket[+Inf]"]
        == after["sglang:inter_token_latency_seconds_count"]
    )
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:gen_throughput"] > 0
    assert after["sglang:cache_hit_rate"] == 0  # (no prefix cache)
    # the served model name is a label value, escaped: it reads back as given
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        labels = {
            s.labels.get("model_name")
            for f in text_string_to_metric_families(r.read().decode())
            for s in f.samples
        }
    assert labels == {'tiny "q\\w"'}


def test_get_server_info_answers_as_sglang(held, call, tiny_model_dir):
    _, _, url = held
    code, info = call(url, "/get_server_info")
    assert code == 200 and call(url, "/server_info")[1].keys() == info.keys()
    assert info["served_model_name"] == 'tiny "q\\w"' and info["context_length"] == 128
    assert info["disable_radix_cache"] is True and info["skip_tokenizer_init"] is False
    assert info["version"].startswith("relax-rollout") and info["tp_size"] == 1
    assert info["internal_states"][0]["last_gen_throughput"] >= 0
    assert "stream" in info["features"] and info["engine"] == "HeldEngine"


def test_a_streamed_agent_session_call_is_recorded_like_a_whole_one(held, client, call):
    """A call naming a session streams too; its turn is recorded once the reply is complete (the tokens
    streamed are the trajectory's), and the session is free for its next call."""
    _, _, url = held
    ask = {
        **ASK,
        "max_tokens": 6,
        "extra_body": {"min_tokens": 6},
        "extra_headers": {"X-Relax-Session": "s1"},
    }
    chunks = list(client.chat.completions.create(**ask, stream=True, logprobs=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    code, traj = call(url, "/relax/trajectories/s1")
    assert code == 200 and traj["num_calls"] == 1
    streamed = [
        e.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert traj["rollout_log_probs"] == pytest.approx(streamed) and len(streamed) == 6
    assert text == client.chat.completions.create(**{**ask, "extra_headers": {}}).choices[0].message.content
    more = [*ASK["messages"], {"role": "assistant", "content": text}, {"role": "user", "content": "2+2="}]
    client.chat.completions.create(**{**ask, "messages": more})
    code, traj = call(url, "/relax/trajectories/s1")
    assert code == 200 and traj["num_calls"] == 2
