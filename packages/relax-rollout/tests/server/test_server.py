"""The engine server in a subprocess: SGLang /generate equals the in-process TorchEngine, pause/continue,
abort, weight updates from disk and over DCS, OpenAI chat, auth and 400s."""

import json
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines import SamplingParams  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402

pytestmark = pytest.mark.integration
EOS = 1
PROMPTS = [[3, 12, 4, 13], [7, 12, 8, 12, 9, 13], [4, 13]]


def test_generate_greedy_equals_in_process_engine(engine_server, call, local):
    # the served engine is shared: other tests update its weights (and restore them) before or after this one
    _, served = call(engine_server, "/get_weight_version")
    code, res = call(
        engine_server,
        "/generate",
        {
            "input_ids": PROMPTS,
            "sampling_params": {"max_new_tokens": 10, "temperature": 0},
            "return_logprob": True,
        },
    )
    assert code == 200 and isinstance(res, list) and len(res) == 3
    want = local.generate(PROMPTS, SamplingParams(max_new_tokens=10, greedy=True))
    for r, w in zip(res, want):
        meta = r["meta_info"]
        assert r["output_ids"] == w.token_ids
        assert [x[1] for x in meta["output_token_logprobs"]] == w.token_ids
        assert all(x[2] is None and len(x) == 3 for x in meta["output_token_logprobs"])
        assert max(abs(x[0] - lp) for x, lp in zip(meta["output_token_logprobs"], w.log_probs)) < 1e-5
        assert meta["completion_tokens"] == len(w.token_ids)
        assert meta["finish_reason"]["type"] == w.finish_reason
        assert meta["weight_version"] == served["weight_version"]
        assert isinstance(r["text"], str)


def test_generate_single_prompt_and_text(engine_server, call):
    code, r = call(
        engine_server, "/generate", {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3}}
    )
    assert code == 200 and isinstance(r, dict) and "output_token_logprobs" not in r["meta_info"]
    code, r = call(
        engine_server, "/generate", {"text": "1+2=", "rid": "abc", "sampling_params": {"max_new_tokens": 2}}
    )
    assert code == 200 and r["meta_info"]["id"] == "abc" and r["meta_info"]["prompt_tokens"] == 4


def test_sampling_params_are_honoured(engine_server, call, local):
    first = local.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, greedy=True))[0].token_ids[0]
    _, r = call(
        engine_server,
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [first]},
        },
    )
    assert r["output_ids"] == [first] and r["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": first,
    }
    _, r = call(
        engine_server,
        "/generate",
        {
            "input_ids": PROMPTS[0],
            "sampling_params": {
                "max_new_tokens": 6,
                "min_new_tokens": 6,
                "temperature": 0.8,
                "sampling_seed": 3,
            },
        },
    )
    assert len(r["output_ids"]) == 6 and EOS not in r["output_ids"]
    assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 6, "top_p": 0.9, "sampling_seed": 7}}
    a = [x["output_ids"] for x in call(engine_server, "/generate", body)[1]]
    b = [x["output_ids"] for x in call(engine_server, "/generate", body)[1]]
    assert a == b
    # one sampling-params dict per prompt
    _, res = call(
        engine_server,
        "/generate",
        {
            "input_ids": PROMPTS[:2],
            "sampling_params": [
                {"max_new_tokens": 4, "min_new_tokens": 4, "temperature": 0},
                {"max_new_tokens": 2, "temperature": 0},
            ],
        },
    )
    assert len(res[0]["output_ids"]) == 4 and len(res[1]["output_ids"]) <= 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"sampling_params": {"max_new_tokens": 2}}, "input_ids"),
        ({"input_ids": [1, "x"]}, "input_ids"),
        ({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
        ({"input_ids": [3, 4], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"input_ids": [3, 4], "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
        (
            {"input_ids": [3, 4], "sampling_params": {"frequency_penalty": 1.0}},
            "sampling_params.frequency_penalty",
        ),
        ({"input_ids": [3, 4], "sampling_params": {"stop_token_ids": "1"}}, "sampling_params.stop_token_ids"),
        ({"input_ids": [3, 4], "return_logprob": "yes"}, "return_logprob"),
        # values that reached the engine: 500s, or random output (NaN / Infinity are JSON literals to Python)
        (
            {"input_ids": [3, 4], "sampling_params": {"temperature": float("nan")}},
            "sampling_params.temperature",
        ),
        ({"input_ids": [3, 4], "sampling_params": {"top_p": float("inf")}}, "sampling_params.top_p"),
        (
            {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 10**12}},
            "input_ids",
        ),  # past the context
        ({"input_ids": [3, 2**63]}, "input_ids"),  # int64 overflow
        ({"input_ids": [3, -1]}, "input_ids"),
        ({"input_ids": [[3, 4], [3, 10**6]]}, "input_ids[1]"),  # outside the vocabulary
        (
            {"input_ids": [3] * 127, "sampling_params": {"max_new_tokens": 2}},
            "input_ids",
        ),  # 129 > 128 positions
        ({"text": "1+1=" * 5000}, "text"),  # refused before it is tokenized
    ],
)
def test_bad_generate_payloads_are_400_naming_the_field(engine_server, call, body, field):
    code, err = call(engine_server, "/generate", body)
    assert code == 400 and err["param"] == field and field in err["message"] and err["object"] == "error"


def test_a_vanishing_temperature_samples_greedily(engine_server, call):
    """SGLang treats a temperature under 1e-6 as greedy; 1e-300 divided the logits into infinities (500)."""
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 1e-300}}
    code, tiny = call(engine_server, "/generate", body)
    assert code == 200
    greedy = call(
        engine_server, "/generate", {**body, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    )[1]
    assert tiny["output_ids"] == greedy["output_ids"]


def test_a_flood_of_concurrent_clients_is_answered_not_reset(engine_server):
    """200 clients at once: the standard library's listen backlog of 5 reset most of them."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    u = urlparse(engine_server)
    start = threading.Barrier(200, timeout=30)

    def health(_):
        start.wait()  # all connect at once
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError as e:
            return type(e).__name__
        finally:
            conn.close()

    with ThreadPoolExecutor(200) as pool:
        codes = list(pool.map(health, range(200)))
    assert codes == [200] * 200, sorted({str(c) for c in codes})


def test_a_request_after_a_404_on_the_same_connection_is_served(engine_server):
    """After a 404 (or 401) the server did not read the request's body, so the next request on the same
    keep-alive connection was parsed from it: a 501 HTML page (seen with curl and the openai client)."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(engine_server)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    headers = {"Content-Type": "application/json"}
    conn.request("POST", "/v1/nope", body=body, headers=headers)
    first = conn.getresponse()
    assert first.status == 404 and json.loads(first.read())["code"] == 404
    conn.request("POST", "/generate", body=body, headers=headers)  # (a client reconnects when told to close)
    second = conn.getresponse()
    assert second.status == 200, second.read()[:200]
    assert len(json.loads(second.read())["output_ids"]) == 2
    conn.close()


def test_slime_and_verl_generate_bodies_are_served_with_their_neutral_defaults(engine_server, call):
    """What slime's and veRL's rollouts send to SGLang's /generate by default: keys this server does not
    implement at the values that change nothing. ``stop: null`` was a 400, ``top_k``/``min_p``/penalties too;
    ``n: 2`` came back as one result. Neutral values pass; any other is a 400 naming the key."""
    slime = {
        "input_ids": PROMPTS[0],
        "return_logprob": True,
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "max_new_tokens": 3,
            "stop": None,
            "stop_token_ids": [],
            "skip_special_tokens": False,
            "no_stop_trim": True,
            "spaces_between_special_tokens": False,
        },
    }
    verl = {
        "input_ids": PROMPTS[0],
        "return_logprob": True,
        "sampling_params": {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "frequency_penalty": 0.0,
            "presence_penalty": 0.0,
            "max_new_tokens": 3,
            "n": 1,
        },
    }
    for body in (slime, verl):
        code, res = call(engine_server, "/generate", body)
        assert code == 200 and 1 <= len(res["output_ids"]) <= 3, res
        assert len(res["meta_info"]["output_token_logprobs"]) == len(res["output_ids"])
    for key, value in (("n", 2), ("top_k", 20), ("repetition_penalty", 1.2), ("min_p", 0.1)):
        body = {"input_ids": PROMPTS[0], "sampling_params": {key: value}}
        code, err = call(engine_server, "/generate", body)
        assert (
            code == 400 and err["param"] == f"sampling_params.{key}" and "not supported" in err["message"]
        ), err


def test_other_400s(engine_server, call):
    assert call(engine_server, "/pause_generation", {"mode": "nap"})[1]["param"] == "mode"
    assert call(engine_server, "/abort_request", {})[1]["param"] == "rid"
    assert call(engine_server, "/update_weights_from_disk", {})[1]["param"] == "model_path"
    assert (
        call(engine_server, "/init_weights_update_group", {"master_address": "127.0.0.1"})[1]["param"]
        == "master_port"
    )
    code, err = call(engine_server, "/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert code == 400 and err["param"] == "messages[0]"
    code, err = call(
        engine_server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "1"}], "max_tokens": -1},
    )
    assert code == 400 and err["param"] == "max_tokens"
    assert call(engine_server, "/nope")[0] == 404


def _generate_in_thread(url, call, body):
    box = {}
    t = threading.Thread(target=lambda: box.update(res=call(url, "/generate", body)))
    t.start()
    return t, box


def test_pause_blocks_new_requests_until_continue(engine_server, call):
    assert call(engine_server, "/pause_generation", {})[1] == {
        "message": "Generation paused successfully.",
        "status": "ok",
    }
    try:
        t, box = _generate_in_thread(
            engine_server,
            call,
            {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
        )
        t.join(0.5)
        assert t.is_alive()  # held, as SGLang holds requests while paused
    finally:
        assert call(engine_server, "/continue_generation", {})[1]["status"] == "ok"
    t.join(30)
    code, r = box["res"]
    assert code == 200 and len(r["output_ids"]) >= 1


def test_pause_abort_mode_aborts_in_flight(engine_server, call):
    body = {"input_ids": [PROMPTS[1]] * 16, "sampling_params": {"max_new_tokens": 120, "min_new_tokens": 120}}
    t, box = _generate_in_thread(engine_server, call, body)
    time.sleep(0.1)
    call(engine_server, "/pause_generation", {"mode": "in_place"})  # freeze it mid-flight (or at the gate)
    t.join(0.3)
    assert t.is_alive()
    call(engine_server, "/pause_generation", {"mode": "abort"})  # SGLang's default mode: abort what runs
    t.join(30)
    call(engine_server, "/continue_generation", {})
    code, res = box["res"]
    assert code == 200
    for r in res:
        assert r["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(r["output_ids"]) < 120 and len(r["output_ids"]) == r["meta_info"]["completion_tokens"]


def test_pause_in_place_resumes_in_flight(engine_server, call):
    body = {"input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 60, "min_new_tokens": 60}}
    t, box = _generate_in_thread(engine_server, call, body)
    time.sleep(0.2)
    call(engine_server, "/pause_generation", {"mode": "in_place"})
    t.join(0.5)
    still_running = t.is_alive()
    call(engine_server, "/continue_generation", {})
    t.join(30)
    r = box["res"][1]
    assert r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 60
    assert still_running or r  # a very fast machine may finish before the pause lands


def test_abort_request_by_rid(engine_server, call):
    long = {
        "input_ids": PROMPTS[1],
        "rid": "long-1",
        "sampling_params": {"max_new_tokens": 120, "min_new_tokens": 120},
    }
    other = {**long, "rid": "other", "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    call(engine_server, "/pause_generation", {"mode": "in_place"})
    t1, box1 = _generate_in_thread(engine_server, call, long)
    t2, box2 = _generate_in_thread(engine_server, call, other)
    time.sleep(0.2)
    assert call(engine_server, "/abort_request", {"rid": "long-1"}) == (200, None)
    t1.join(30)
    call(engine_server, "/continue_generation", {})
    t2.join(30)
    r = box1["res"][1]
    assert r["meta_info"]["id"] == "long-1" and r["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(r["output_ids"]) < 120
    assert box2["res"][1]["meta_info"]["finish_reason"]["type"] != "abort"  # only that rid


def test_update_weights_from_disk_changes_outputs_and_version(engine_server, call, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}
    before = call(engine_server, "/generate", body)[1]
    v0 = int(call(engine_server, "/get_model_info")[1]["weight_version"])
    sums0 = call(engine_server, "/weights_checksum")[1]["checksum"]
    tensors = load_file(f"{tiny_model_dir}/model.safetensors")
    g = torch.Generator().manual_seed(5)
    tensors["lm_head.weight"] = torch.randn(tensors["lm_head.weight"].shape, generator=g)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    code, res = call(
        engine_server,
        "/update_weights_from_disk",
        {"model_path": str(tmp_path), "weight_version": str(v0 + 7)},
    )
    assert code == 200 and res["success"] is True and "num_paused_requests" in res
    after = call(engine_server, "/generate", body)[1]
    assert [x["output_ids"] for x in after] != [x["output_ids"] for x in before]
    assert all(x["meta_info"]["weight_version"] == str(v0 + 7) for x in after)
    assert call(engine_server, "/get_weight_version")[1] == {"weight_version": str(v0 + 7)}
    # restore (version defaults to current + 1)
    assert call(engine_server, "/update_weights_from_disk", {"model_path": tiny_model_dir})[0] == 200
    assert call(engine_server, "/get_model_info")[1]["weight_version"] == str(v0 + 8)
    assert call(engine_server, "/weights_checksum")[1]["checksum"] == sums0
    assert [x["output_ids"] for x in call(engine_server, "/generate", body)[1]] == [
        x["output_ids"] for x in before
    ]


def _join_group(port: int, group_name: str, **extra) -> dict:
    """An /init_weights_update_group body: the server joins as rank 1 of a two-rank gloo group on ``port``."""
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
        "group_name": group_name,
        **extra,
    }


def test_update_weights_over_dcs(engine_server, call, local):
    from relax_core.dcs import WeightSender
    from relax_core.net import free_port

    port = free_port()
    sender = WeightSender(f"tcp://127.0.0.1:{port}", world_size=2)
    v0 = int(call(engine_server, "/get_model_info")[1]["weight_version"])
    t = threading.Thread(target=sender.connect)
    t.start()
    code, res = call(
        engine_server, "/init_weights_update_group", _join_group(port, "relax_dcs", protocol="relax_dcs")
    )
    t.join(30)
    assert code == 200 and res["success"], res
    try:
        box = {}
        assert call(engine_server, "/begin_weight_update", {})[0] == 200
        w = threading.Thread(
            target=lambda: box.update(
                res=call(
                    engine_server,
                    "/update_weights_from_distributed",
                    {"names": [], "dtypes": [], "shapes": [], "weight_version": str(v0 + 1)},
                )
            )
        )
        w.start()
        sender.broadcast(local.named_weights(), v0 + 1)  # the same weights the server started with
        w.join(30)
        assert box["res"][0] == 200 and box["res"][1]["success"]
        assert call(engine_server, "/get_weight_version")[1]["weight_version"] == str(v0 + 1)
        assert call(engine_server, "/weights_checksum")[1]["checksum"] == local.weights_checksum()
    finally:
        assert call(engine_server, "/end_weight_update", {})[0] == 200
        closer = threading.Thread(target=sender.close)
        closer.start()
        assert call(engine_server, "/destroy_weights_update_group", {})[0] == 200
        closer.join(30)


def test_update_weights_over_sglang_weight_group(engine_server, call, local, tiny_model_dir):
    """SGLang's protocol: the server joins rank 0's group (built as SGLang builds it); inside a
    begin/end weight-update session (refused outside one, as SGLang 0.5.23 does), each
    /update_weights_from_distributed takes its tensors from rank 0's broadcast — one per tensor, or one
    flattened bucket — and they are applied with the request that carries weight_version."""
    from relax_core.net import free_port
    from relax_rollout.engines import weight_group as wg
    from relax_rollout.engines.wire_weights import distributed_update_request, tensor_metadata

    assert (
        call(
            engine_server,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "protocol": "nccl2",
            },
        )[1]["param"]
        == "protocol"
    )
    assert (
        call(
            engine_server,
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2},
        )[1]["param"]
        == "rank_offset"
    )
    port = free_port()
    box = {}
    joiner = threading.Thread(
        target=lambda: box.update(
            res=call(engine_server, "/init_weights_update_group", _join_group(port, "sg"))
        )
    )
    joiner.start()
    pg = wg.new_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "sg", timeout_s=60)
    joiner.join(30)
    assert box["res"][0] == 200 and box["res"][1]["success"]
    v0 = int(call(engine_server, "/get_model_info")[1]["weight_version"])
    sums0 = call(engine_server, "/weights_checksum")[1]["checksum"]
    g = torch.Generator().manual_seed(3)
    new = {k: torch.randn(v.shape, generator=g) for k, v in local.named_weights()}
    items = list(new.items())
    first, rest = items[:2], items[2:]

    def update(bucket, version, load_format):
        body = distributed_update_request(
            *tensor_metadata(bucket), version, "sg", flush_cache=version is not None, load_format=load_format
        )
        t = threading.Thread(
            target=lambda: box.update(res=call(engine_server, "/update_weights_from_distributed", body))
        )
        t.start()
        wg.send(pg, bucket, load_format)
        t.join(30)
        assert box["res"][0] == 200 and box["res"][1]["success"], box["res"]

    code, err = call(
        engine_server,
        "/update_weights_from_distributed",
        distributed_update_request(*tensor_metadata(first), None, "sg"),
    )
    assert (code, err["success"]) == (400, False) and "between begin_weight_update()" in err["message"]
    assert call(engine_server, "/end_weight_update", {})[0] == 400  # no session open
    assert call(engine_server, "/begin_weight_update", {})[0] == 200
    assert call(engine_server, "/begin_weight_update", {})[1]["message"].startswith(
        "a weight-update session is"
    )
    try:
        update(first, None, None)  # per-tensor broadcasts; held: no version yet
        assert call(engine_server, "/get_model_info")[1]["weight_version"] == str(v0)
        assert call(engine_server, "/weights_checksum")[1]["checksum"] == sums0
        update(rest, v0 + 1, wg.FLATTENED)  # one flattened bucket, with the version: all applied
        assert call(engine_server, "/get_model_info")[1]["weight_version"] == str(v0 + 1)
        from relax_core.dcs import checksum

        assert call(engine_server, "/weights_checksum")[1]["checksum"] == checksum(items)
        code, err = call(
            engine_server,
            "/update_weights_from_distributed",
            {"names": ["x"], "dtypes": ["f"], "shapes": [[1]], "group_name": "other"},
        )
        assert code == 400 and err["param"] == "group_name"
    finally:
        assert call(engine_server, "/end_weight_update", {})[0] == 200
        assert call(engine_server, "/destroy_weights_update_group", {"group_name": "sg"})[0] == 200
        wg.destroy_group(pg)
        assert call(engine_server, "/update_weights_from_disk", {"model_path": tiny_model_dir})[0] == 200
    assert call(engine_server, "/weights_checksum")[1]["checksum"] == sums0


def test_openai_chat_completion_and_models(engine_server, call):
    code, models = call(engine_server, "/v1/models")
    assert code == 200 and models["object"] == "list" and len(models["data"]) == 1
    name = models["data"][0]["id"]
    code, r = call(
        engine_server,
        "/v1/chat/completions",
        {
            "model": name,
            "messages": [{"role": "user", "content": "1+2="}],
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
        },
    )
    assert code == 200 and r["object"] == "chat.completion"
    ch = r["choices"][0]
    assert isinstance(ch["message"]["content"], str) and ch["message"]["role"] == "assistant"
    assert ch["finish_reason"] in ("stop", "length") and 1 <= len(ch["token_ids"]) <= 5
    assert len(ch["logprobs"]["content"]) == len(ch["token_ids"])
    u = r["usage"]
    assert u["completion_tokens"] == len(ch["token_ids"]) and u["prompt_tokens"] == len(r["prompt_token_ids"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # the prompt ids are the chat template applied to the messages
    _, g = call(
        engine_server,
        "/generate",
        {"input_ids": r["prompt_token_ids"], "sampling_params": {"max_new_tokens": 5, "temperature": 0}},
    )
    assert g["output_ids"] == ch["token_ids"]


def test_the_official_openai_client_streams_samples_n_and_sends_content_parts(engine_server):
    """What agent frameworks send through the official client: ``stream=True`` (a 400 before), ``n=2``
    (a 400), and OpenAI's list-of-parts message content (a 400); media parts are refused by name."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{engine_server}/v1", api_key="x", max_retries=0)
    ask = {
        "model": "default",
        "messages": [{"role": "user", "content": "1+2="}],
        "max_tokens": 4,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    parts = {
        **ask,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]}
        ],
    }
    assert (
        client.chat.completions.create(**parts).choices[0].message.content == whole.choices[0].message.content
    )
    two = client.chat.completions.create(**{**ask, "temperature": 1.0, "seed": 3}, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in two.choices
    )
    # fields this server does not implement: their neutral values pass, others are refused by name
    assert client.chat.completions.create(
        **ask, stop=None, presence_penalty=0.0, frequency_penalty=0.0
    ).choices
    for field, value in (("presence_penalty", 1.0), ("frequency_penalty", 0.5)):
        with pytest.raises(openai.BadRequestError, match=f"{field}.*not supported"):
            client.chat.completions.create(**ask, **{field: value})
    image = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}],
    }
    with pytest.raises(openai.BadRequestError, match="multimodal model"):
        client.chat.completions.create(**{**ask, "messages": [image]})


def test_token_required_for_control_endpoints(tiny_model_dir, call, local):
    from relax_rollout.server import EngineServer, make_server

    httpd = make_server(EngineServer(local, token="s3cret"), "127.0.0.1", 0)  # in-process: no start-up cost
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        for path, body in [
            ("/pause_generation", {}),
            ("/continue_generation", {}),
            ("/abort_request", {"abort_all": True}),
            ("/update_weights_from_disk", {"model_path": tiny_model_dir}),
        ]:
            assert call(url, path, body)[0] == 401
            assert call(url, path, body, token="wrong")[0] == 401
            assert call(url, path, body, token="s3cret")[0] == 200, path
        # generation and health stay open
        assert call(url, "/health")[0] == 200
        assert (
            call(url, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}})[0] == 200
        )
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_non_loopback_host_needs_a_token(tiny_model_dir):
    import subprocess
    import sys

    from relax_rollout.server import EngineServer, make_server

    r = subprocess.run(
        [sys.executable, "-m", "relax_rollout.server", "--model", tiny_model_dir, "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "--token" in r.stderr
    with pytest.raises(ValueError, match="--token"):
        make_server(EngineServer(engine=object()), host="0.0.0.0")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_rollout.server",
            "--model",
            tiny_model_dir,
            "--host",
            "0.0.0.0",
            "--token",
            " ",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "the token is blank" in r.stderr
    httpd = make_server(EngineServer(engine=object(), token="t"), host="127.0.0.2")  # a token: allowed
    httpd.server_close()


def test_memory_release_and_resume_over_http(tiny_model_dir, call):
    """SGLang's /release_memory_occupation and /resume_memory_occupation: while released, /generate is 503
    with what to do; bad tags are a 400 naming the field; both need the token like the other controls."""
    from relax_rollout.server import EngineServer, make_server

    engine = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)
    httpd = make_server(EngineServer(engine, token="s3cret"), "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    gen = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    try:
        _, want = call(url, "/generate", gen)
        assert call(url, "/release_memory_occupation", {})[0] == 401
        assert call(url, "/release_memory_occupation", {}, token="s3cret") == (200, None)
        code, err = call(url, "/generate", gen)
        assert code == 503 and "resume_memory_occupation" in err["message"]
        code, err = call(url, "/resume_memory_occupation", {"tags": ["weights", "gpu"]}, token="s3cret")
        assert code == 400 and "tags" in err["message"] and "gpu" in err["message"]
        assert call(url, "/resume_memory_occupation", {"tags": ["weights"]}, token="s3cret")[0] == 200
        assert call(url, "/generate", gen)[0] == 503  # the KV cache is still released
        assert (
            call(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, token="s3cret")[0]
            == 200
        )
        code, got = call(url, "/generate", gen)
        assert code == 200 and got["output_ids"] == want["output_ids"]
    finally:
        httpd.shutdown()
        httpd.server_close()


def _scrape(url: str) -> dict[str, float]:
    """``GET /metrics`` parsed: sample name (histogram buckets by their ``le``) -> value, summed over the
    other labels (SGLang splits some by ``is_streaming``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            name = sample.name + (f"[{le}]" if le else "")
            out[name] = out.get(name, 0.0) + sample.value
    return out


def test_prometheus_metrics_follow_the_load(engine_server, call):
    """Upstream Relax scales engines with KEDA on SGLang's metrics; ours had none to scrape."""
    before = _scrape(engine_server)
    assert before["sglang:num_queue_reqs"] == 0 and before["sglang:num_running_reqs"] == 0
    call(engine_server, "/pause_generation", {})
    try:
        body = {
            "input_ids": [PROMPTS[0], PROMPTS[1]],
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        }
        t, box = _generate_in_thread(engine_server, call, body)
        deadline = time.monotonic() + 10
        while _scrape(engine_server)["sglang:num_queue_reqs"] != 2:  # held while paused: queued
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        call(engine_server, "/continue_generation", {})
    t.join(30)
    made = sum(len(r["output_ids"]) for r in box["res"][1])
    after = _scrape(engine_server)
    assert after["sglang:num_queue_reqs"] == 0 and after["sglang:num_running_reqs"] == 0
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == made
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == len(
        PROMPTS[0]
    ) + len(PROMPTS[1])
    assert (
        after["sglang:e2e_request_latency_seconds_count"] - before["sglang:e2e_request_latency_seconds_count"]
        == 2
    )
    assert (
        after["sglang:e2e_request_latency_seconds_bucket[+Inf]"]
        == after["sglang:e2e_request_latency_seconds_count"]
    )
    assert after["relax:weight_version"] == float(
        call(engine_server, "/get_weight_version")[1]["weight_version"]
    )


def test_completions_tokenize_and_info_as_sglang_serves_them(engine_server, call):
    """``/v1/completions`` (``bench_serving --backend sglang-oai`` died on its 404), ``/tokenize``,
    ``/detokenize``, ``/server_info`` and ``/flush_cache``; the completion through the official client."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{engine_server}/v1", api_key="x", max_retries=0)
    code, tok = call(engine_server, "/tokenize", {"prompt": "1+2="})
    assert code == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 128
    assert call(engine_server, "/detokenize", {"tokens": tok["tokens"]})[1]["text"] == "1+2="
    done = client.completions.create(model="default", prompt="1+2=", max_tokens=4, temperature=0, logprobs=0)
    ids = done.choices[0].model_extra["token_ids"]
    assert (
        len(done.choices[0].logprobs.token_logprobs) == len(ids) and done.usage.prompt_tokens == tok["count"]
    )
    _, g = call(
        engine_server,
        "/generate",
        {"input_ids": tok["tokens"], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
    )
    assert g["output_ids"] == ids  # the same greedy tokens as SGLang's native route
    streamed = client.completions.create(
        model="default", prompt=tok["tokens"], max_tokens=4, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
    # SGLang's extra sampling keys: their neutral values pass, others are refused by name (were ignored)
    body = {"prompt": "1+2=", "max_tokens": 2, "temperature": 0}
    assert call(engine_server, "/v1/completions", {**body, "top_k": -1, "repetition_penalty": 1.0})[0] == 200
    for key, value in (("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2)):
        code, err = call(engine_server, "/v1/completions", {**body, key: value})
        assert code == 400 and key in str(err), (key, err)
    code, info = call(engine_server, "/server_info")
    assert code == 200 and info["context_length"] == 128 and info["version"].startswith("relax-rollout")
    import urllib.request

    with urllib.request.urlopen(
        urllib.request.Request(engine_server + "/flush_cache", data=b"", method="POST")
    ) as r:
        assert r.status == 200 and r.read() == b"Cache flushed.\n"  # (SGLang's plain-text answer)
