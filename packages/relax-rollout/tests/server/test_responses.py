"""OpenAI's Responses API (``/v1/responses``) on the engine server, driven by the real ``openai`` client:
text, function calls and their outputs, ``previous_response_id``, streaming events, errors; and one tool
conversation through Chat Completions, Responses and Messages recorded as the same tokens and masks (#55)."""

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [{"type": "function", "name": "add", "description": "a + b", "parameters": SCHEMA}]
ASK = "What is 1+2? Use the tools."


def _client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _tool_turns(client, headers=None, chain: bool = False):
    first = client.responses.create(
        model="m", input=[{"role": "user", "content": ASK}], tools=TOOLS, extra_headers=headers
    )
    call = next(o for o in first.output if o.type == "function_call")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
    if chain:  # the server keeps the conversation
        return first, client.responses.create(
            model="m", previous_response_id=first.id, input=[result], tools=TOOLS, extra_headers=headers
        )
    given = {
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": '{"a": 1, "b": 2}',
    }
    history = [{"role": "user", "content": ASK}, given, result]
    return first, client.responses.create(model="m", input=history, tools=TOOLS, extra_headers=headers)


def test_a_tool_conversation_through_the_openai_client_and_previous_response_id(tool_server):
    client = _client(tool_server([CALL, "The answer is 3", CALL, "The answer is 3"]))
    for chain in (False, True):
        first, second = _tool_turns(client, chain=chain)
        call = next(o for o in first.output if o.type == "function_call")
        assert (
            first.status == "completed"
            and call.name == "add"
            and json.loads(call.arguments) == {"a": 1, "b": 2}
        )
        assert (
            second.output_text == "The answer is 3" and second.usage.input_tokens > first.usage.input_tokens
        )
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model="m", previous_response_id="resp_nope", input="hi")


def test_streaming_events_and_a_cut_response(tool_server):
    client = _client(tool_server(["Hello there", CALL, "a long reply that is cut"]))
    with client.responses.stream(model="m", input="hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == "Hello there" and final.output_text == "Hello there"
    with client.responses.stream(model="m", input=ASK, tools=TOOLS) as stream:  # (a call: whole, at the end)
        final = stream.get_final_response()
    call = next(o for o in final.output if o.type == "function_call")
    assert json.loads(call.arguments) == {"a": 1, "b": 2}
    cut = client.responses.create(model="m", input="hi", max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_what_is_not_served_is_refused_naming_the_field(tool_server):
    client = _client(tool_server())
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\].type"):
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="input\\[0\\].content\\[0\\]"):
        client.responses.create(
            model="m", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        )


def test_one_conversation_through_the_three_protocols_is_the_same_tokens_and_masks(tool_server, call):
    url = tool_server([CALL, "The answer is 3"] * 3)
    _tool_turns(_client(url), {"X-Relax-Session": "via-responses"})
    chat = _client(url)
    tools = [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
        for t in TOOLS
    ]
    session = {"X-Relax-Session": "via-chat"}
    ask = [{"role": "user", "content": ASK}]
    first = chat.chat.completions.create(model="m", messages=ask, tools=tools, extra_headers=session)
    c = first.choices[0].message.tool_calls[0]
    sent = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        ],
    }
    chat.chat.completions.create(
        model="m",
        messages=[*ask, sent, {"role": "tool", "tool_call_id": c.id, "content": "3"}],
        tools=tools,
        extra_headers=session,
    )
    msgs = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    a_tools = [{"name": "add", "description": "a + b", "input_schema": SCHEMA}]
    head = {"X-Relax-Session": "via-messages"}
    m1 = msgs.messages.create(model="m", max_tokens=64, messages=ask, tools=a_tools, extra_headers=head)
    use = next(b for b in m1.content if b.type == "tool_use")
    turn = [
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": "add", "input": use.input}],
        }
    ]
    result = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]}]
    msgs.messages.create(
        model="m", max_tokens=64, messages=[*ask, *turn, *result], tools=a_tools, extra_headers=head
    )
    got = {
        name: call(url, f"/relax/trajectories/{name}")[1]
        for name in ("via-chat", "via-responses", "via-messages")
    }
    tokens = {n: t["tokens"] for n, t in got.items()}
    masks = {n: t["loss_mask"] for n, t in got.items()}
    assert all(t["num_calls"] == 2 for t in got.values())
    assert tokens["via-chat"] == tokens["via-responses"] == tokens["via-messages"]
    assert masks["via-chat"] == masks["via-responses"] == masks["via-messages"] and 0 in masks["via-chat"]


TWO_CALLS = (
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_the_openai_agents_sdk_runs_a_two_tool_agent_unmodified(tool_server):
    agents = pytest.importorskip("agents")
    url = tool_server([TWO_CALLS, "It is 3, and sunny in Oslo."])
    ran: list[tuple[str, dict]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """a + b"""
        ran.append(("add", {"a": a, "b": b}))
        return a + b

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(("get_weather", {"city": city}))
        return "sunny"

    agents.set_tracing_disabled(True)  # (its traces would go to OpenAI's servers: not reachable here)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    model = agents.OpenAIResponsesModel(model="m", openai_client=client)
    agent = agents.Agent(name="calc", instructions="Use the tools.", tools=[add, get_weather], model=model)
    result = agents.Runner.run_sync(agent, "What is 1+2, and the weather in Oslo?")
    assert sorted(ran) == [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]
    assert result.final_output == "It is 3, and sunny in Oslo."


def test_a_real_engine_streams_the_text_token_by_token(chat_model_dir, serve):
    from transformers import AutoTokenizer

    from relax_rollout.engines.torch_engine import TorchEngine

    tok = AutoTokenizer.from_pretrained(chat_model_dir)
    engine = TorchEngine(
        model_path=chat_model_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    client = _client(serve(engine, tok))
    events = list(client.responses.create(model="m", input="1+2=", max_output_tokens=8, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    last = events[-1]  # (cut at 8 tokens: "response.incomplete", as OpenAI's API ends such a stream)
    assert last.type in ("response.completed", "response.incomplete") and [
        e.sequence_number for e in events
    ] == list(range(len(events)))
    assert len(deltas) > 1 and "".join(deltas) == last.response.output_text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"model": "m", "input": "x", "previous_response_id": ["r"]}, "previous_response_id"),
        ({"model": "m", "input": "x", "tools": [None]}, "tools[0]"),
        ({"model": "m", "input": "x", "tools": 5}, "tools"),
        ({"model": "m", "input": "x", "text": "json"}, "text"),
        ({"model": "m", "input": "x", "text": {"format": 1}}, "text.format"),
    ],
)
def test_malformed_fields_are_a_400_naming_them_not_a_500(tool_server, call, body, field):
    """What the no-500 fuzzing found (a 500 each before): a 400 in OpenAI's error shape naming the field."""
    status, out = call(tool_server(), "/v1/responses", body)
    assert status == 400 and out["error"]["param"] == field, out
    assert out["error"]["type"] == "invalid_request_error"
