"""SGLang's constrained-decoding sampling params on ``/generate`` (``json_schema``, ``regex``): the torch
engine's response matches; a bad schema or regex, both at once, or an engine without constrained decoding
is a 400 naming the key (they were refused as unknown keys before)."""

import json
import re

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def url(serve, chat_model_dir):
    from transformers import AutoTokenizer

    from relax_rollout.engines.torch_engine import TorchEngine

    return serve(TorchEngine(model_path=chat_model_dir), AutoTokenizer.from_pretrained(chat_model_dir))


def test_json_schema_and_regex_constrain_the_response(url, call):
    sp = {"max_new_tokens": 60, "temperature": 1.0, "json_schema": json.dumps(SCHEMA)}
    code, res = call(url, "/generate", {"text": ["1+2=", "What now?"], "sampling_params": sp})
    assert code == 200, res
    for r in res:
        obj = json.loads(r["text"])
        assert set(obj) == {"n", "ok"} and 0 <= obj["n"] <= 99 and isinstance(obj["ok"], bool)
        assert r["meta_info"]["finish_reason"]["type"] == "stop"
    sp = {"max_new_tokens": 30, "regex": "(yes|no) [0-9]{2}"}
    code, r = call(url, "/generate", {"text": "1+2=", "sampling_params": sp})
    assert code == 200 and re.fullmatch("(yes|no) [0-9]{2}", r["text"]), r


def test_sglang_any_json_is_the_empty_schema():
    from relax_rollout.engines.base import Constraint
    from relax_rollout.server.protocol import parse_sampling

    params, _ = parse_sampling({"json_schema": "$$ANY$$"})  # SGLang's "any JSON"
    assert params.constraint == Constraint("json_schema", "{}")
    assert parse_sampling({"max_new_tokens": 3})[0].constraint is None


@pytest.mark.parametrize(
    ("sp", "param", "message"),
    [
        ({"regex": "("}, "sampling_params.regex", "does not compile"),
        ({"json_schema": "{"}, "sampling_params.json_schema", "not valid JSON"),
        ({"json_schema": "{}", "regex": "a"}, "sampling_params.regex", "only one of"),
        ({"regex": 3}, "sampling_params.regex", "non-empty string"),
        ({"ebnf": "root ::= 'a'"}, "sampling_params.ebnf", "not supported"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_key(url, call, sp, param, message):
    code, err = call(url, "/generate", {"input_ids": [3, 4], "sampling_params": sp})
    assert code == 400 and err["param"] == param and message in err["message"], err


class _PlainEngine:
    """An engine without constrained decoding."""

    weight_version = 0
    features = frozenset({"stop"})

    def generate(self, prompts, params):
        from relax_rollout.engines.base import GenerateOutput

        return [GenerateOutput([5], [-1.0], "length", 0) for _ in prompts]

    def update_weights(self, tensors, version): ...

    def weights_checksum(self):
        return ""


def test_an_engine_without_constrained_decoding_is_a_400_naming_the_key(serve, call, chat_model_dir):
    from transformers import AutoTokenizer

    url = serve(_PlainEngine(), AutoTokenizer.from_pretrained(chat_model_dir))
    for key, value in (("regex", "a+"), ("json_schema", json.dumps(SCHEMA))):
        code, err = call(url, "/generate", {"input_ids": [3, 4], "sampling_params": {key: value}})
        assert code == 400 and err["param"] == f"sampling_params.{key}", err
        assert "does not implement" in err["message"]
    code, _ = call(url, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}})
    assert code == 200
