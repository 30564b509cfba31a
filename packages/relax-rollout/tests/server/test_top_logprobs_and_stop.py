"""Top log-probs and stop strings over the wire (#25): OpenAI chat (``logprobs`` + ``top_logprobs``) and legacy
completions (``logprobs: k``) through the official ``openai`` client, SGLang's ``/generate``
(``top_logprobs_num``, ``sampling_params.stop``), and a 400 naming the field from an engine that has neither.
They were: ``top_logprobs: []`` in chat, ``top_logprobs: null`` in completions, ``top_logprobs_num`` ignored,
and ``stop`` refused."""

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from relax_rollout.engines import SamplingParams  # noqa: E402

pytestmark = pytest.mark.integration
EOS = 1
ASK = {"model": "default", "messages": [{"role": "user", "content": "1+2="}], "temperature": 0}


@pytest.fixture(scope="module")
def client(engine_server):
    return openai.OpenAI(base_url=f"{engine_server}/v1", api_key="x", max_retries=0)


def _stop_inside(text: str) -> tuple[str, int]:
    """Two characters of ``text`` (one token each in this vocabulary) and where they first appear (> 0)."""
    at = next((i for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i), None)
    assert at is not None, text
    return text[at : at + 2], at


def test_chat_top_logprobs_in_openai_shape(client):
    res = client.chat.completions.create(**ASK, max_tokens=4, logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == len(res.choices[0].model_extra["token_ids"]) == res.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert (
            entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        )  # greedy
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert all(t.bytes == list(t.token.encode()) for t in entry.top_logprobs) and entry.bytes == list(
            entry.token.encode()
        )
    plain = client.chat.completions.create(**ASK, max_tokens=4, logprobs=True)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    for extra, field in (
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**ASK, max_tokens=2, **extra)
        assert e.value.body["param"] == field


def test_chat_stop_cuts_the_text_and_keeps_the_tokens(client):
    free = client.chat.completions.create(**ASK, max_tokens=8, extra_body={"min_tokens": 8})
    text, ids = free.choices[0].message.content, free.choices[0].model_extra["token_ids"]
    stop, at = _stop_inside(text)
    res = client.chat.completions.create(
        **ASK, max_tokens=8, stop=["zz-never", stop], logprobs=True, extra_body={"min_tokens": 8}
    )
    ch = res.choices[0]
    assert (
        ch.message.content == text[:at]
        and ch.finish_reason == "stop"
        and ch.model_extra["matched_stop"] == stop
    )
    # the trainer's view: every token generated, the two of the stop string included, with their log-probs
    assert ch.model_extra["token_ids"] == ids[: at + 2]
    assert len(ch.logprobs.content) == at + 2 == res.usage.completion_tokens
    one = client.chat.completions.create(**ASK, max_tokens=8, stop=stop, extra_body={"min_tokens": 8})
    assert one.choices[0].message.content == text[:at]
    streamed = client.chat.completions.create(
        **ASK, max_tokens=8, stop=stop, stream=True, extra_body={"min_tokens": 8}
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text[:at]
    with pytest.raises(openai.BadRequestError, match="at most 4") as e:
        client.chat.completions.create(**ASK, max_tokens=2, stop=list("abcde"))
    assert e.value.body["param"] == "stop"


def test_completions_top_logprobs_and_stop(client, local):
    res = client.completions.create(model="default", prompt="1+2=", max_tokens=4, temperature=0, logprobs=2)
    lp = res.choices[0].logprobs
    assert len(lp.top_logprobs) == len(lp.tokens) == len(res.choices[0].model_extra["token_ids"])
    for token, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert (
            len(top) == 2
            and max(top.values()) == pytest.approx(tok_lp)
            and top[token] == pytest.approx(tok_lp)
        )
    assert (
        client.completions.create(model="default", prompt="1+2=", max_tokens=2, logprobs=0)
        .choices[0]
        .logprobs.top_logprobs
        is None
    )
    free = client.completions.create(
        model="default", prompt="1+2=", max_tokens=8, temperature=0, extra_body={"min_tokens": 8}
    )
    stop, at = _stop_inside(free.choices[0].text)
    cut = client.completions.create(
        model="default", prompt="1+2=", max_tokens=8, temperature=0, stop=stop, extra_body={"min_tokens": 8}
    )
    ch = cut.choices[0]
    assert (
        ch.text == free.choices[0].text[:at]
        and ch.finish_reason == "stop"
        and ch.model_extra["matched_stop"] == stop
    )
    assert ch.model_extra["token_ids"] == free.choices[0].model_extra["token_ids"][: at + 2]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="1+2=", max_tokens=2, logprobs=21)
    assert e.value.body["param"] == "logprobs"


def test_generate_top_logprobs_num_in_sglang_shape(engine_server, call, local):
    prompt = [3, 12, 4, 13]
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "top_logprobs_num": 3,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    code, r = call(engine_server, "/generate", body)
    assert code == 200, r
    want = local.generate([prompt], SamplingParams(max_new_tokens=4, greedy=True, top_logprobs=3))[0]
    tops = r["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(r["output_ids"]) == len(want.token_ids)
    for row, ref in zip(
        tops, want.top_logprobs
    ):  # per token [[logprob, token_id, text], ...], most likely first
        assert [x[1] for x in row] == [t for t, _ in ref] and all(len(x) == 3 and x[2] is None for x in row)
        assert [x[0] for x in row] == pytest.approx([lp for _, lp in ref], abs=1e-5)
    _, r = call(engine_server, "/generate", {**body, "return_text_in_logprobs": True})
    texts = [x[2] for x in r["meta_info"]["output_token_logprobs"]]
    assert "".join(texts) == r["text"] or r["meta_info"]["finish_reason"]["type"] == "stop"
    assert all(isinstance(x[2], str) for row in r["meta_info"]["output_top_logprobs"] for x in row)
    # SGLang: top log-probs come with return_logprob only; per prompt in a batch
    _, r = call(engine_server, "/generate", {**body, "return_logprob": False})
    assert "output_top_logprobs" not in r["meta_info"] and "output_token_logprobs" not in r["meta_info"]
    _, rs = call(
        engine_server, "/generate", {**body, "input_ids": [prompt, prompt], "top_logprobs_num": [1, 0]}
    )
    assert [len(x) for x in rs[0]["meta_info"]["output_top_logprobs"]] == [1] * len(rs[0]["output_ids"])
    assert "output_top_logprobs" not in rs[1]["meta_info"]
    for bad, field in ((21, "top_logprobs_num"), (-1, "top_logprobs_num"), ([1], "top_logprobs_num")):
        code, err = call(
            engine_server, "/generate", {**body, "input_ids": [prompt, prompt], "top_logprobs_num": bad}
        )
        assert code == 400 and err["param"] == field, err


def test_generate_stop_strings_as_sglang(engine_server, call):
    """SGLang's semantics: ``output_ids`` keep the token that completed the string, the text is cut before
    it (through it with ``no_stop_trim``), ``finish_reason`` is ``{"type": "stop", "matched": <string>}``."""
    sp = {"max_new_tokens": 8, "temperature": 0, "min_new_tokens": 8}
    _, free = call(engine_server, "/generate", {"text": "1+2=", "sampling_params": sp})
    stop, at = _stop_inside(free["text"])
    code, r = call(
        engine_server,
        "/generate",
        {"text": "1+2=", "return_logprob": True, "sampling_params": {**sp, "stop": [stop]}},
    )
    assert code == 200, r
    assert r["text"] == free["text"][:at] and r["output_ids"] == free["output_ids"][: at + 2]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert len(r["meta_info"]["output_token_logprobs"]) == at + 2 == r["meta_info"]["completion_tokens"]
    _, kept = call(
        engine_server,
        "/generate",
        {"text": "1+2=", "sampling_params": {**sp, "stop": stop, "no_stop_trim": True}},
    )
    assert kept["text"] == free["text"][: at + 2]
    # a stop token that is not special is cut from the text too (SGLang's trim_matched_stop), kept in the ids
    sp0 = {"max_new_tokens": 8, "temperature": 0}
    _, free0 = call(engine_server, "/generate", {"text": "1+2=", "sampling_params": sp0})
    n = len(free0["output_ids"]) - 1
    assert n > 0 and free0["output_ids"][n] != EOS, free0
    _, r = call(
        engine_server,
        "/generate",
        {"text": "1+2=", "sampling_params": {**sp0, "stop_token_ids": [free0["output_ids"][n]]}},
    )
    first = free0["output_ids"].index(free0["output_ids"][n])
    assert r["output_ids"] == free0["output_ids"][: first + 1] and r["text"] == free0["text"][:first]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": free0["output_ids"][n]}
    code, err = call(engine_server, "/generate", {"text": "1+2=", "sampling_params": {"stop": ["a"] * 33}})
    assert code == 400 and err["param"] == "sampling_params.stop", err
    code, err = call(engine_server, "/generate", {"text": "1+2=", "sampling_params": {"stop": [1]}})
    assert code == 400 and err["param"] == "sampling_params.stop", err


class _PlainEngine:
    """An engine with neither optional feature: it answers one token, whatever is asked."""

    weight_version = 0

    def generate(self, prompts, params):
        from relax_rollout.engines.base import GenerateOutput

        return [GenerateOutput([5], [-1.0], "length", 0) for _ in prompts]

    def update_weights(self, tensors, version): ...

    def weights_checksum(self):
        return ""


def test_an_engine_without_them_is_a_400_naming_the_field(serve, call, tiny_model_dir):
    from transformers import AutoTokenizer

    url = serve(_PlainEngine(), AutoTokenizer.from_pretrained(tiny_model_dir))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(**ASK, max_tokens=1, logprobs=True).choices[0].logprobs.content
    for extra, field in (({"logprobs": True, "top_logprobs": 2}, "top_logprobs"), ({"stop": "a"}, "stop")):
        with pytest.raises(openai.BadRequestError, match="does not implement") as e:
            client.chat.completions.create(**ASK, max_tokens=1, **extra)
        assert e.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="default", prompt="1", max_tokens=1, logprobs=1)
    assert e.value.body["param"] == "logprobs"
    for body, field in (
        ({"return_logprob": True, "top_logprobs_num": 1}, "top_logprobs_num"),
        ({"sampling_params": {"stop": "a"}}, "sampling_params.stop"),
    ):
        code, err = call(url, "/generate", {"input_ids": [3, 4], **body})
        assert code == 400 and err["param"] == field, err
