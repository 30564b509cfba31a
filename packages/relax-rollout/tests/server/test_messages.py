"""Anthropic's Messages API (``/v1/messages``) on the engine server, driven by the real ``anthropic`` client:
text, tool use and tool results, streaming events, errors in Anthropic's shape, the stop reasons (#55). The
same conversation through the three protocols, recorded alike: ``test_responses.py``."""

import pytest

anthropic = pytest.importorskip("anthropic")

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
TOOLS = [
    {
        "name": "add",
        "description": "a + b",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    }
]
ASK = [{"role": "user", "content": "What is 1+2? Use the tools."}]


def _client(url: str):
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)


def _tool_turns(client, headers=None):
    """A tool conversation: the call, its result, the answer."""
    first = client.messages.create(model="m", max_tokens=64, messages=ASK, tools=TOOLS, extra_headers=headers)
    use = next(b for b in first.content if b.type == "tool_use")
    turn = [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]
    result = [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]
    history = [*ASK, {"role": "assistant", "content": turn}, {"role": "user", "content": result}]
    second = client.messages.create(
        model="m", max_tokens=64, messages=history, tools=TOOLS, extra_headers=headers
    )
    return first, second


def test_a_tool_conversation_through_the_anthropic_client(tool_server):
    client = _client(tool_server([CALL, "The answer is 3"]))
    first, second = _tool_turns(client)
    assert first.stop_reason == "tool_use" and first.role == "assistant" and first.type == "message"
    use = next(b for b in first.content if b.type == "tool_use")
    assert (use.name, use.input) == ("add", {"a": 1, "b": 2})
    assert second.stop_reason == "end_turn" and [b.text for b in second.content] == ["The answer is 3"]
    assert second.usage.input_tokens > first.usage.input_tokens and second.usage.output_tokens > 0


def test_streaming_events_build_the_same_message(tool_server):
    client = _client(tool_server(["Hello there", CALL]))
    with client.messages.stream(model="m", max_tokens=32, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (
        text == "Hello there" and final.content[0].text == "Hello there" and final.stop_reason == "end_turn"
    )
    with client.messages.stream(model="m", max_tokens=64, messages=ASK, tools=TOOLS) as stream:
        final = stream.get_final_message()
    use = next(b for b in final.content if b.type == "tool_use")
    assert final.stop_reason == "tool_use" and use.input == {"a": 1, "b": 2}


def test_errors_come_in_anthropics_shape_naming_the_field(tool_server):
    client = _client(tool_server())
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=8, messages=ASK, extra_body={"top_k": 5})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "top_k" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="messages\\[0\\].content\\[0\\]"):
        client.messages.create(
            model="m",
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],
        )


def test_a_reply_ended_by_one_of_the_stop_sequences_says_which():
    from relax_rollout.server.messages_routes import from_chat

    def chat(finish, matched):
        choice = {"message": {"content": "12"}, "finish_reason": finish, "matched_stop": matched}
        return {"choices": [choice], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}

    by_stop = from_chat(chat("stop", "\n\nUser:"), "m", ["\n\nUser:"])
    assert (by_stop["stop_reason"], by_stop["stop_sequence"]) == ("stop_sequence", "\n\nUser:")
    by_eos = from_chat(chat("stop", 2), "m", ["\n\nUser:"])  # (an EOS token id)
    assert (by_eos["stop_reason"], by_eos["stop_sequence"]) == ("end_turn", None)
    cut = from_chat(chat("length", None), "m", [])
    assert cut["stop_reason"] == "max_tokens" and cut["usage"] == {"input_tokens": 5, "output_tokens": 2}


@pytest.mark.parametrize("tools", [[None], 5, ["f"]])
def test_malformed_tools_are_a_400_in_anthropics_shape_not_a_500(tool_server, call, tools):
    """What the no-500 fuzzing found (``"tools": [null]`` was a 500)."""
    body = {"model": "m", "max_tokens": 4, "messages": ASK, "tools": tools}
    status, out = call(tool_server(), "/v1/messages", body)
    assert status == 400 and out["type"] == "error" and "tools" in out["error"]["message"], out
