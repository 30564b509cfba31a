"""Constrained decoding (``SamplingParams.constraint``): on a tiny random Qwen3 with the demo's byte-level BPE
tokenizer, sampled at temperature 1, every response matches its JSON schema / regex / tool-call format;
the log-probs are those of the masked distribution; constrained and plain requests share a batch; and the
constraint goes to SGLang under its own sampling-param names."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines.base import Constraint, SamplingParams  # noqa: E402
from relax_rollout.engines.constrained import check_constraint, grammar_of, sglang_constraint  # noqa: E402
from relax_rollout.engines.continuous import ContinuousBatcher  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402
from relax_rollout.engines.wire import generate_body  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["n", "colour", "ok", "tag"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,3}[!?]"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": [1, 2]}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: an empty object
]
OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
JSON_C = Constraint("json_schema", json.dumps(SCHEMA))
REGEX_C = Constraint("regex", REGEX)
TOOLS_C = Constraint("tool_calls", json.dumps(TOOLS), open=OPEN, close=CLOSE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 with the demo's byte-level BPE tokenizer (any text is some token sequence) and, as
    in a real Qwen3 checkpoint, ``<tool_call>`` and ``</tool_call>`` added as plain (``special: false``)
    tokens."""
    tokenizer = pytest.importorskip("relax_app.demo.tokenizer")
    model = pytest.importorskip("relax_app.demo.model")
    out = tmp_path_factory.mktemp("byte_qwen3")
    corpus = [f"{a}+{b}={a + b}" for a in range(30) for b in range(0, 30, 3)] + [
        '{"name": "add", "arguments": {"a": 1, "b": 2}}',
        "<tool_call>\n</tool_call> yes no red green blue true false Paris Oslo",
    ]
    tok = tokenizer.train_tokenizer(corpus, out)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.save_pretrained(out)
    model.build_tiny_qwen3(tok, out_dir=out, **model.SMALLEST, max_position_embeddings=1024)
    return str(out)


@pytest.fixture(scope="module")
def engine(model_dir):
    torch.set_num_threads(1)
    return TorchEngine(model_path=model_dir)


@pytest.fixture(scope="module")
def tok(engine):
    return engine.tokenizer


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in ["1+2=", "What now?", "3+4=7", "a", "<tool_call>", "red"]]


def validate(obj, schema):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(obj, schema)


def body_text(out, tok) -> str:
    """The response's text without its final EOS (which a "stop" keeps in ``token_ids``)."""
    ids = out.token_ids
    if out.finish_reason == "stop" and ids and ids[-1] == tok.eos_token_id:
        ids = ids[:-1]
    return tok.decode(ids)


def check_tool_calls(text: str, finished: bool, names: set[str]) -> list[dict]:
    """The calls of ``open + json + close`` blocks separated by newlines; a response cut by the length limit
    may end inside one. Returns the complete calls, each checked against its tool."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    one = re.escape(OPEN) + r"(.+?)" + re.escape(CLOSE)
    if finished:
        assert re.fullmatch(f"{one}(?:\n{one})*", text, re.S), text
    else:
        assert text.startswith(OPEN[: len(text)]), text
    calls = [json.loads(m) for m in re.findall(one, text, re.S)]
    for call in calls:
        assert set(call) == {"name", "arguments"} and call["name"] in names, call
        validate(call["arguments"], schemas[call["name"]] or {"type": "object", "maxProperties": 0})
    return calls


def test_json_schema_output_always_parses_and_validates(engine, tok, prompts):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=120, seed=0, constraint=JSON_C))
    for out in outs:
        assert out.finish_reason == "stop" and out.token_ids[-1] == tok.eos_token_id, out
        validate(json.loads(body_text(out, tok)), SCHEMA)
        assert all(lp <= 0.0 and lp > float("-inf") for lp in out.log_probs)
    assert len({body_text(o, tok) for o in outs}) > 1  # sampled, not one forced string


def test_regex_output_fullmatches(engine, tok, prompts):
    for out in engine.generate(prompts, SamplingParams(max_new_tokens=40, seed=1, constraint=REGEX_C)):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, body_text(out, tok)), body_text(out, tok)


def test_tool_calls_are_open_json_close_with_a_listed_tool(engine, tok, prompts):
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=200, seed=2, constraint=TOOLS_C))
    names = {t["function"]["name"] for t in TOOLS}
    tag = tok.convert_tokens_to_ids("<tool_call>")
    for out in outs:
        calls = check_tool_calls(body_text(out, tok), out.finish_reason == "stop", names)
        assert calls, body_text(out, tok)
        assert out.token_ids[0] == tag  # the tag as its one token, as the model was trained to write it
    assert any(o.finish_reason == "stop" for o in outs)
    named = Constraint("tool_calls", json.dumps(TOOLS), open=OPEN, close=CLOSE, required_name="add")
    for out in engine.generate(prompts[:3], SamplingParams(max_new_tokens=120, seed=3, constraint=named)):
        assert check_tool_calls(body_text(out, tok), out.finish_reason == "stop", {"add"})


def test_forced_text_of_an_added_tag_token_is_spelt_out(engine, tok, prompts):
    """llguidance offers ``<tool_call>`` (an added token it treats as special) where a regex forces that text,
    then refuses it: the engine spells the text out in plain tokens instead of failing."""
    c = Constraint("regex", "<tool_call>[ab]{2}")
    for out in engine.generate(prompts[:2], SamplingParams(max_new_tokens=30, seed=6, constraint=c)):
        assert out.finish_reason == "stop" and re.fullmatch("<tool_call>[ab]{2}", body_text(out, tok))
        assert tok.convert_tokens_to_ids("<tool_call>") not in out.token_ids


def test_mixed_batch_with_different_and_no_constraints(engine, tok, prompts):
    """The continuous batch runs constrained and plain requests side by side, each under its own matcher;
    a plain request's tokens are those it gets alone (constraints beside it cost it nothing)."""
    plain = SamplingParams(max_new_tokens=30, seed=7)
    batcher = ContinuousBatcher(engine, max_running=8)
    try:
        alone = batcher.submit(prompts[0], plain).result()
        futures = [
            batcher.submit(prompts[1], SamplingParams(max_new_tokens=120, seed=1, constraint=JSON_C)),
            batcher.submit(prompts[0], plain),
            batcher.submit(prompts[2], SamplingParams(max_new_tokens=40, seed=2, constraint=REGEX_C)),
            batcher.submit(prompts[3], SamplingParams(max_new_tokens=200, seed=3, constraint=TOOLS_C)),
        ]
        js, beside, rx, tools = [f.result() for f in futures]
    finally:
        batcher.close()
    assert beside.token_ids == alone.token_ids and beside.log_probs == pytest.approx(alone.log_probs)
    assert js.finish_reason == "stop" and js.token_ids[-1] == tok.eos_token_id
    validate(json.loads(body_text(js, tok)), SCHEMA)
    assert rx.finish_reason == "stop" and re.fullmatch(REGEX, body_text(rx, tok))
    check_tool_calls(
        body_text(tools, tok), tools.finish_reason == "stop", {t["function"]["name"] for t in TOOLS}
    )
    # the batch path: plain and constrained calls of one engine leave each other alone
    mixed = engine.generate([prompts[0]], SamplingParams(max_new_tokens=30, seed=7))
    assert (
        mixed[0].token_ids
        == engine.generate([prompts[0]], SamplingParams(max_new_tokens=30, seed=7))[0].token_ids
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_are_the_masked_distributions(engine, tok, prompts, temperature):
    """Each returned log-prob is log softmax(logits / T) over the tokens the grammar allowed at that step
    (recomputed here from one forward of the model and a fresh llguidance matcher), not the model's own."""
    from llguidance import LLMatcher

    prompt = prompts[1]
    p = SamplingParams(max_new_tokens=120, seed=5, temperature=temperature, constraint=JSON_C)
    out = engine.generate([prompt], p)[0]
    assert out.finish_reason == "stop"
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    matcher = LLMatcher(engine.guide.tokenizer, grammar_of(JSON_C))
    eos = tok.eos_token_id
    want, free = [], []
    for t, token in enumerate(out.token_ids):
        bits = matcher.compute_bitmask()
        allowed = torch.tensor(
            [bits[i // 8] >> (i % 8) & 1 for i in range(logits.shape[-1])], dtype=torch.bool
        )
        allowed[eos] = matcher.is_accepting()
        if matcher.is_stopped():
            allowed[:] = False
            allowed[eos] = True
        row = logits[t].masked_fill(~allowed, float("-inf"))
        want.append(torch.log_softmax(row, -1)[token].item())
        free.append(torch.log_softmax(logits[t], -1)[token].item())
        if token != eos:
            assert matcher.consume_token(token)
    assert out.log_probs == pytest.approx(want, abs=1e-4)
    assert out.log_probs[-1] == 0.0  # the grammar was complete: EOS alone
    assert all(g >= f - 1e-5 for g, f in zip(out.log_probs, free)) and sum(out.log_probs) > sum(free) + 1


def test_a_match_completed_by_the_last_allowed_token_is_a_stop(engine, tok, prompts):
    a = Constraint("regex", "a")
    cut = engine.generate([prompts[0]], SamplingParams(max_new_tokens=1, constraint=a))[0]
    assert cut.finish_reason == "stop" and tok.decode(cut.token_ids) == "a"
    full = engine.generate([prompts[0]], SamplingParams(max_new_tokens=5, constraint=a, min_new_tokens=4))[0]
    assert full.token_ids == [*cut.token_ids, tok.eos_token_id] and full.log_probs[-1] == 0.0
    assert full.finish_reason == "stop" and cut.log_probs == [0.0]  # "a" is the only token that matches
    batcher = ContinuousBatcher(engine)
    try:
        assert (
            batcher.submit(prompts[0], SamplingParams(max_new_tokens=1, constraint=a)).result().finish_reason
            == "stop"
        )
    finally:
        batcher.close()


def test_constraint_errors_name_what_to_fix(engine, prompts):
    with pytest.raises(
        ValueError, match=r"Constraint.kind must be one of \['json_schema', 'regex', 'tool_calls'\]"
    ):
        Constraint("grammar", "x")
    with pytest.raises(ValueError, match="required_name is only for kind 'tool_calls'"):
        Constraint("regex", "a", required_name="f")
    with pytest.raises(ValueError, match="spec must be a non-empty string"):
        Constraint("regex", "")
    bad = [
        (Constraint("regex", "("), "the regex does not compile"),
        (Constraint("json_schema", "{"), "not valid JSON"),
        (Constraint("json_schema", '{"type": "objekt"}'), "does not compile"),
        (Constraint("tool_calls", "[]"), "non-empty JSON list of tools"),
        (Constraint("tool_calls", json.dumps(TOOLS), required_name="nope"), "'nope' is not among the tools"),
    ]
    for c, message in bad:
        with pytest.raises(ValueError, match=message):
            check_constraint(c)
        with pytest.raises(ValueError, match=message):
            engine.generate([prompts[0]], SamplingParams(max_new_tokens=2, constraint=c))
    check_constraint(TOOLS_C)


def test_features_say_constraint_where_a_tokenizer_is(engine):
    assert "constraint" in engine.features
    assert "constraint" not in TorchEngine(model=engine.model).features


# -- SGLang ----------------------------------------------------------------------------------------------
def test_sglang_gets_its_own_sampling_param_names():
    from relax_rollout.engines.sglang import SGLangEngine

    assert "constraint" in SGLangEngine.features
    body = generate_body([[1, 2]], SamplingParams(max_new_tokens=4, constraint=JSON_C), [0])
    assert body["sampling_params"]["json_schema"] == JSON_C.spec and "regex" not in body["sampling_params"]
    assert sglang_constraint(REGEX_C) == {"regex": REGEX}
    assert "json_schema" not in generate_body([[1]], SamplingParams(max_new_tokens=1), [0])["sampling_params"]
    named = Constraint("tool_calls", json.dumps(TOOLS), open=OPEN, close=CLOSE, required_name="add")
    for c, names in ((TOOLS_C, ["get_weather", "add", "now"]), (named, ["add"])):
        sp = generate_body([[1]], SamplingParams(max_new_tokens=9, constraint=c), [0])["sampling_params"]
        assert set(sp) == {"max_new_tokens", "temperature", "top_p", "min_new_tokens", "structural_tag"}
        tag = json.loads(sp["structural_tag"])
        assert tag["type"] == "structural_tag"
        fmt = tag["format"]  # xgrammar's: one or more tags, separated, no other text
        assert fmt["type"] == "tags_with_separator" and fmt["at_least_one"] and not fmt["stop_after_first"]
        assert fmt["separator"] == "\n" and len(fmt["tags"]) == 1
        t = fmt["tags"][0]
        assert t["type"] == "tag" and t["begin"] == OPEN and t["end"] == CLOSE
        calls = t["content"]["json_schema"]["anyOf"]
        assert [s["properties"]["name"]["const"] for s in calls] == names
        assert all(s["required"] == ["name", "arguments"] for s in calls)


class _Info(BaseHTTPRequestHandler):
    info: dict = {}

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps(self.info).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    ("info", "listed"),
    [
        ({"grammar_backend": "xgrammar"}, True),
        ({"grammar_backend": "none"}, False),
        ({"version": "relax"}, False),
    ],
)
def test_external_engine_passes_constraints_only_to_sglang_with_a_grammar_backend(info, listed):
    from relax_rollout.engines.external import ExternalEngine

    handler = type("Info", (_Info,), {"info": info})
    httpd = HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        eng = ExternalEngine(urls=[f"http://127.0.0.1:{httpd.server_address[1]}"], retries=0)
        assert ("constraint" in eng.features) is listed and "stop" in eng.features
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_special_tokens_in_open_and_close_are_those_tokens(engine, tok, prompts):
    """A tag that is one of the tokenizer's special tokens is emitted as that token (a string literal would
    spell it out in plain tokens, a tokenization the model never saw)."""
    start = tok.convert_tokens_to_ids("<|im_start|>")
    c = Constraint("tool_calls", json.dumps(TOOLS[1:2]), open="<|im_start|>call ", close="<|im_start|>")
    for out in engine.generate(prompts[:2], SamplingParams(max_new_tokens=60, seed=4, constraint=c)):
        assert out.token_ids[0] == start and start in out.token_ids[1:], out.token_ids
        text = tok.decode(out.token_ids, skip_special_tokens=False)
        assert text.startswith('<|im_start|>call {"name": "add", "arguments": {"a": '), text


# -- undeclared keys, as SGLang's grammar backend reads a schema (#50) -------------------------------------
STRICT_CASES = {
    "declared": {"type": "object", "properties": {"a": {"type": "string"}}},
    "free": {"type": "object"},
    "nested": {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    },
    "allowed": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer"}]},
    "defs": {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    },
}
STRICT_TEXTS = [
    '{"a": "x"}',
    '{"a": "x", "b": 1}',
    "{}",
    '{"a": {"x": 1}}',
    '{"a": {"x": 1, "y": 2}}',
    "[1]",
    "[1, 2]",
]
STRICT_TEXTS += ['{"p": {"x": 1}}', '{"p": {"x": 1, "z": 0}}']
XGRAMMAR = """
import json, sys
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string
cases, texts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
print(json.dumps({n: [_is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(s)), t) for t in texts]
                  for n, s in cases.items()}))
"""


def test_json_schemas_take_the_keys_sglangs_grammar_backend_takes(engine, tok, sglang_python):
    """What SGLang 0.5.23 decodes under a schema (xgrammar, its default backend, strict mode: no key an object
    with ``properties`` does not declare, no item past ``prefixItems``) is what the torch engine decodes:
    each text accepted or refused alike, by xgrammar in SGLang's venv and by our llguidance grammar."""
    import subprocess

    from llguidance import LLMatcher

    def ours(schema: dict, text: str) -> bool:
        matcher = LLMatcher(engine.guide.tokenizer, grammar_of(Constraint("json_schema", json.dumps(schema))))
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    args = [sglang_python, "-c", XGRAMMAR, json.dumps(STRICT_CASES), json.dumps(STRICT_TEXTS)]
    theirs = json.loads(subprocess.run(args, capture_output=True, text=True, check=True, timeout=120).stdout)
    got = {name: [ours(schema, t) for t in STRICT_TEXTS] for name, schema in STRICT_CASES.items()}
    assert got == theirs
    assert theirs["declared"][:2] == [True, False] and theirs["free"][1]  # (what the cases are for)
