"""Tool calls and structured output on ``/v1/chat/completions``, driven by the real ``openai`` client (and
LangChain): a two-tool agent loop on the demo model and on a tool-capable tiny Qwen3 (the reply's calls
forced by constrained decoding, then parsed with transformers' response template), ``response_format``
JSON that validates, calls parsed from scripted replies (``auto``, thinking, broken calls), agent sessions
that record a tool conversation token-exactly, and the 400s that name the field."""

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["answer", "ok"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is 1+2, and what is the weather in Oslo?"}]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def _run(name: str, arguments: dict) -> str:
    return "sunny" if name == "get_weather" else str(arguments["a"] + arguments["b"])


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module", params=["demo", "tool_tokens"])
def torch_server(request, serve):
    """A TorchEngine (constrained decoding) served in-process, on the demo model and on the tool-capable one."""
    from transformers import AutoTokenizer

    from relax_rollout.engines.torch_engine import TorchEngine

    model_dir = request.getfixturevalue("chat_model_dir" if request.param == "demo" else "tool_model_dir")
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = TorchEngine(
        model_path=model_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    return serve(engine, tok), tok


@pytest.fixture(scope="module")
def tool_tok(tool_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_model_dir)


@pytest.fixture
def scripted_server(tool_model_dir, tool_tok, scripted, serve):
    """``start(replies) -> (url, engine)``: a server whose engine replies with scripted texts."""

    def start(replies=()):
        engine = scripted(tool_model_dir, replies)
        return serve(engine, tool_tok), engine

    return start


@pytest.fixture(scope="module")
def plain_url(tool_model_dir, tool_tok, scripted, serve) -> str:
    """A server whose engine has no constrained decoding (every reply "ok")."""
    return serve(scripted(tool_model_dir), tool_tok)


def _validate_calls(message) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def test_two_tool_agent_loop(torch_server):
    """Call (a call forced by ``required``), tool results (the assistant turn sent back with content null),
    final answer (``none``: tools not shown; ``auto``: shown, nothing called)."""
    url, tok = torch_server
    client = _client(url)
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0, seed=3
    )
    choice = first.choices[0]  # (a random model may chain calls until max_tokens: the complete ones count)
    assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
    calls = _validate_calls(choice.message)
    assert "<tools>" in tok.decode(first.model_extra["prompt_token_ids"])
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in calls
            ],
        },
        *(
            {
                "role": "tool",
                "tool_call_id": c.id,
                "content": _run(c.function.name, json.loads(c.function.arguments)),
            }
            for c in calls
        ),
    ]
    for mode in ("none", "auto"):
        final = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice=mode, max_tokens=6, temperature=1.0, seed=5
        )
        answer = final.choices[0]
        assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)
        assert not answer.message.tool_calls
        prompt = tok.decode(final.model_extra["prompt_token_ids"])
        assert ("<tools>" in prompt) == (mode == "auto") and prompt.count("<tool_response>") == len(calls)


def test_forced_calls_on_parameters_that_allow_any_key_parse_every_time(torch_server):
    """TOOLS' parameters do not say ``additionalProperties`` (LangChain's ``@tool`` and pydantic's default):
    decoded as JSON Schema reads them, a forced call could add made-up keys until ``max_tokens`` and come
    back as cut text without ``tool_calls`` (6 of 10 before). Decoded as SGLang's grammar backend reads
    them, only the declared keys: 10 seeds, 10 replies whose calls parse, none with an undeclared key."""
    url, tok = torch_server
    if "<tool_call>" not in tok.get_added_vocab():
        pytest.skip(
            "the demo model's context holds the tool list and little more: the tool-capable one runs it"
        )
    client = _client(url)
    for seed in range(10):
        reply = client.chat.completions.create(
            model="m",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=48,
            temperature=1.0,
            seed=seed,
        )
        for call in _validate_calls(reply.choices[0].message):
            schema = {**SCHEMAS[call.function.name], "additionalProperties": False}
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_named_tool_choice_calls_that_tool(torch_server):
    url, _ = torch_server
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2):
        res = _client(url).chat.completions.create(
            model="m", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200, seed=seed
        )
        calls = _validate_calls(res.choices[0].message)
        assert {c.function.name for c in calls} == {"get_weather"}


def test_a_forced_tool_whose_parameters_refer_to_their_defs_is_called(torch_server):
    """Parameters as pydantic writes a nested model (``$defs`` and ``$ref``): before (#49), a forced call was
    refused with "Pointer '/$defs/P' does not exist" (the pointer read from the call schema's root), while
    the same schema worked as response_format."""
    url, _ = torch_server
    nested = {
        "$defs": {
            "Place": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            }
        },
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}},
        "required": ["place"],
        "additionalProperties": False,  # (the tiny model would add keys until max_tokens)
    }
    tool = {"type": "function", "function": {"name": "where", "parameters": nested}}
    named = {"type": "function", "function": {"name": "where"}}
    res = _client(url).chat.completions.create(
        model="m", messages=ASK, tools=[tool], tool_choice=named, max_tokens=200, seed=1
    )
    assert res.choices[0].message.tool_calls, res
    for call in res.choices[0].message.tool_calls:
        assert call.function.name == "where"
        jsonschema.validate(json.loads(call.function.arguments), nested)


def test_response_format_json_validates(torch_server):
    url, _ = torch_server
    client = _client(url)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    res = client.chat.completions.create(model="m", messages=ASK, response_format=fmt, max_tokens=100, seed=1)
    assert res.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(res.choices[0].message.content), ANSWER)
    res = client.chat.completions.create(
        model="m", messages=ASK, response_format={"type": "json_object"}, max_tokens=100, seed=2
    )
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError, match="nonsense") as e:
        client.chat.completions.create(model="m", messages=ASK, response_format=bad)
    assert e.value.body["param"] == "response_format.json_schema.schema"
    # (any object: a random model's keys are random strings, which may run to max_tokens)
    json_object = res.choices[0]
    assert json_object.message.content.startswith("{")
    if json_object.finish_reason == "stop":
        assert isinstance(json.loads(json_object.message.content), dict)


def test_langchain_bind_tools_and_structured_output(torch_server):
    lc = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: int
        ok: bool

    url, _ = torch_server
    llm = lc.ChatOpenAI(base_url=f"{url}/v1", api_key="x", model="m", max_tokens=200, max_retries=0, seed=4)
    reply = llm.bind_tools(TOOLS, tool_choice="required").invoke("What is 1+2?")
    assert reply.tool_calls and all(c["name"] in SCHEMAS for c in reply.tool_calls)
    for c in reply.tool_calls:
        jsonschema.validate(c["args"], SCHEMAS[c["name"]])
    out = llm.with_structured_output(Answer).invoke("What is 1+2?")
    assert isinstance(out, Answer)


def test_auto_parses_calls_and_thinking_from_the_reply(scripted_server):
    url, _ = scripted_server(
        [
            f"<think>\nadd them\n</think>\n\n{CALL}",
            f"Let me add.\n{CALL}\n<tool_call>\n"
            + '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not an offered tool
            '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>',  # broken JSON
            CALL,  # tool_choice none: not parsed
            "<think>\nsimple\n</think>\n\n3",  # thinking without tools
        ]
    )
    client = _client(url)
    ask = {"model": "m", "messages": ASK, "tools": TOOLS}
    first = client.chat.completions.create(**ask).choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.model_extra["reasoning_content"] == "add them"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first.message.tool_calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    two = client.chat.completions.create(**ask).choices[0]
    assert two.message.content == "Let me add." and [c.function.name for c in two.message.tool_calls] == [
        "add",
        "get_weather",
    ]
    assert len({c.id for c in two.message.tool_calls}) == 2
    for _ in range(2):  # an unknown tool, a broken call: the text as it is, no calls
        plain = client.chat.completions.create(**ask).choices[0]
        assert (
            plain.finish_reason == "stop"
            and not plain.message.tool_calls
            and '"name"' in plain.message.content
        )
    off = client.chat.completions.create(**ask, tool_choice="none").choices[0]
    assert off.finish_reason == "stop" and not off.message.tool_calls and '"add"' in off.message.content
    think = client.chat.completions.create(model="m", messages=ASK).choices[0]
    assert think.message.content == "3" and think.message.model_extra["reasoning_content"] == "simple"


def test_parallel_tool_calls_false_returns_one_call_and_streams_calls(scripted_server):
    url, _ = scripted_server([f"{CALL}\n{CALL}", CALL])
    client = _client(url)
    one = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    chunks = list(client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert [(d.tool_calls[0].index, d.tool_calls[0].function.name) for d in deltas] == [(0, "add")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_tool_session_is_recorded_token_exactly(scripted_server, tool_tok, call):
    """The assistant's call turn is its tokens as generated, the tool result the template's suffix: the
    trajectory is generated tokens + template tokens, and equals the template's rendering of the whole
    conversation (the scripted tokens are canonical)."""
    url, _ = scripted_server([CALL, "The answer is 3"])
    client = _client(url)
    session = {"X-Relax-Session": "tools-1"}
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, extra_headers=session)
    c = first.choices[0].message.tool_calls[0]
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}
        ],
    }
    messages = [*ASK, sent, {"role": "tool", "tool_call_id": c.id, "content": "3"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, extra_headers=session)
    assert second.model_extra["relax_trajectory"] == {"session": "tools-1", "index": 0, "num_calls": 2}
    _, t = call(url, "/relax/trajectories/tools-1")
    p1, out1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    p2, out2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    gap = p2[len(p1) + len(out1) :]
    assert p2[: len(p1) + len(out1)] == p1 + out1 and t["tokens"] == p1 + out1 + gap + out2
    assert (
        tool_tok.decode(gap)
        == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert t["loss_mask"] == [1] * len(out1) + [0] * len(gap) + [1] * len(out2)
    as_generated = {
        **sent,
        "tool_calls": [{**sent["tool_calls"][0], "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
    }
    whole = [*ASK, as_generated, messages[-1], {"role": "assistant", "content": "The answer is 3"}]
    text = tool_tok.apply_chat_template(whole, tools=TOOLS, tokenize=False).removesuffix("\n")
    assert t["tokens"] == tool_tok(text, add_special_tokens=False)["input_ids"]
    # other tools than the trajectory's: the system turn would change, so a new trajectory starts
    client.chat.completions.create(model="m", messages=messages, tools=TOOLS[:1], extra_headers=session)
    _, t = call(url, "/relax/trajectories/tools-1")
    assert t["index"] == 1


def test_chat_template_kwargs_reach_the_template(tool_model_dir, tool_tok, scripted, serve):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tool_model_dir)
    tok.chat_template = "{% if greeting is defined %}{{ greeting }}{% endif %}" + tok.chat_template
    res = _client(serve(scripted(tool_model_dir), tok)).chat.completions.create(
        model="m", messages=ASK, extra_body={"chat_template_kwargs": {"greeting": "HELLO"}}
    )
    assert tok.decode(res.model_extra["prompt_token_ids"]).startswith("HELLO<|im_start|>user")


@pytest.mark.parametrize(
    "extra, field, says",
    [
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0]", "'content' or 'tool_calls'"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]", "role"),
        ({"messages": [{"role": "user"}]}, "messages[0]", "content"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}],
                    },
                ]
            },
            "messages[1].tool_calls[0].function",
            "name",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "nope",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "auto"),
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
            "pattern",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "unique"),
        ({"logit_bias": {"5": 10}}, "logit_bias", "not supported"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs", "dictionary"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice", "does not implement"),
        ({"response_format": {"type": "json_object"}}, "response_format", "does not implement"),
    ],
)
def test_bad_requests_name_the_field(plain_url, call, extra, field, says):
    code, err = call(plain_url, "/v1/chat/completions", {"messages": ASK, **extra})
    assert code == 400 and err["param"] == field and says in err["message"], err


def test_a_tool_conversation_is_accepted_as_openai_sends_it(scripted_server, call):
    """The second request of every tool agent (assistant content null + tool_calls, then a tool message)
    was a 400; an empty ``logit_bias`` and a ``text`` response format change nothing."""
    url, _ = scripted_server(["3"])
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    body = {"messages": messages, "tools": TOOLS, "logit_bias": {}, "response_format": {"type": "text"}}
    code, res = call(url, "/v1/chat/completions", body)
    assert code == 200 and res["choices"][0]["message"] == {"role": "assistant", "content": "3"}
