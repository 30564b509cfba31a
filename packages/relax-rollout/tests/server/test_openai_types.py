"""The OpenAI routes' response bodies are typed (``server.openai_types``): a wrong shape is the server's
error naming the field, a right one comes back exactly as built and parses as the ``openai`` package's own
types."""

import pytest

from relax_rollout.server.openai_types import ResponseShapeError, body

openai_chat = pytest.importorskip("openai.types.chat")


def _chat(message: dict, finish: str = "tool_calls") -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": finish, "token_ids": [5, 6]}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "weight_version": 4,  # an extension: kept
    }


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}


def test_a_tool_call_reply_comes_back_as_built_and_parses_as_openais_type():
    built = _chat({"role": "assistant", "content": None, "tool_calls": [CALL]})
    out = body(built)
    assert out == built  # None content kept, the extension kept, no default added
    parsed = openai_chat.ChatCompletion.model_validate(out)
    assert parsed.choices[0].message.tool_calls[0].function.arguments == '{"a": 1}'


def test_arguments_given_as_an_object_are_the_servers_error_naming_the_field():
    bad = {**CALL, "function": {"name": "add", "arguments": {"a": 1}}}
    with pytest.raises(ResponseShapeError, match=r"choices\.0\.message\.tool_calls\.0\.function\.arguments"):
        body(_chat({"role": "assistant", "content": None, "tool_calls": [bad]}))


def test_an_unknown_finish_reason_and_a_chunk_without_delta_are_refused():
    with pytest.raises(ResponseShapeError, match="finish_reason"):
        body(_chat({"role": "assistant", "content": "hi"}, finish="done"))
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0}],
    }
    with pytest.raises(ResponseShapeError, match=r"choices\.0\.delta"):
        body(chunk)
    chunk["choices"][0]["delta"] = {"tool_calls": [{"index": 0, **CALL}]}
    assert (
        openai_chat.ChatCompletionChunk.model_validate(body(chunk)).choices[0].delta.tool_calls[0].index == 0
    )
