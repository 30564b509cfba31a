"""Prompt log-probs on SGLang's ``/generate`` (#25): ``logprob_start_len`` → ``meta_info.input_token_logprobs``
(and ``input_top_logprobs``), ``max_new_tokens: 0`` (the prompt alone) and the ``stop_regex: []`` the SGLang
frontend sends with every ``gen``. Before, the frontend's ``gen`` died on ``stop_regex``, its ``select`` and
``fork`` on ``max_new_tokens: 0``, and ``logprob_start_len`` was ignored (no ``input_token_logprobs``)."""

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.integration
PROMPT = [3, 12, 4, 13, 5]  # "1+2=3" in the tiny vocabulary
ONLY_PROMPT = {"max_new_tokens": 0}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from relax_core.models import load_model

    return load_model(tiny_model_dir, "float32").eval()


def _reference(model, ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """(log p(ids[j] | ids[:j]) for j ≥ 1, the log-softmax rows) from one unpadded forward."""
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    return lp.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1).tolist(), lp


def test_input_token_logprobs_in_sglang_shape(engine_server, call, model):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 0,
        "sampling_params": ONLY_PROMPT,
    }
    code, r = call(engine_server, "/generate", body)
    assert code == 200, r
    meta = r["meta_info"]
    assert (
        r["text"] == "" and r["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    )
    assert (
        meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    )
    want, _ = _reference(model, PROMPT)
    rows = meta["input_token_logprobs"]  # per prompt token [logprob, token_id, text], the first logprob None
    assert [x[1] for x in rows] == PROMPT and all(x[2] is None for x in rows) and rows[0][0] is None
    assert [x[0] for x in rows[1:]] == pytest.approx(want, abs=1e-5)
    # from position 2: the tail, whose first log-prob is None too (SGLang's; the frontend's select relies on it)
    _, r = call(engine_server, "/generate", {**body, "logprob_start_len": 2, "return_text_in_logprobs": True})
    assert r["meta_info"]["input_token_logprobs"] == [
        [None, 4, "2"],
        [pytest.approx(want[2], abs=1e-5), 13, "="],
        [pytest.approx(want[3], abs=1e-5), 5, "3"],
    ]
    # while generating: the same values (from the prefill); the default start (-1) lists none, as in SGLang
    gen = {**body, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    _, r = call(engine_server, "/generate", gen)
    assert [x[0] for x in r["meta_info"]["input_token_logprobs"][1:]] == pytest.approx(want, abs=1e-5)
    assert len(r["output_ids"]) == len(r["meta_info"]["output_token_logprobs"]) > 0
    _, r = call(engine_server, "/generate", {**gen, "logprob_start_len": None})
    assert r["meta_info"]["input_token_logprobs"] == [] and len(r["meta_info"]["output_token_logprobs"]) > 0
    _, r = call(
        engine_server, "/generate", {**gen, "return_logprob": False}
    )  # (SGLang ignores the start then)
    assert "input_token_logprobs" not in r["meta_info"]


def test_a_batch_of_unequal_prompts_gets_each_its_own(engine_server, call, model):
    """Left padding must not leak into the log-probs; one start per prompt."""
    texts, starts = ["1+2=3", "12+34=46", "7"], [0, 3, 1]
    code, rs = call(
        engine_server,
        "/generate",
        {"text": texts, "return_logprob": True, "logprob_start_len": starts, "sampling_params": ONLY_PROMPT},
    )
    assert code == 200, rs
    for text, start, r in zip(texts, starts, rs):
        ids = [2 + int(c) if c.isdigit() else {"+": 12, "=": 13}[c] for c in text]
        rows = r["meta_info"]["input_token_logprobs"]
        assert [x[1] for x in rows] == ids[start:] and (not rows or rows[0][0] is None)
        want, _ = _reference(model, ids) if len(ids) > 1 else ([], None)
        assert [x[0] for x in rows[1:]] == pytest.approx(want[start:], abs=1e-4)


def test_input_top_logprobs_with_top_logprobs_num(engine_server, call, model):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 3,
        "sampling_params": ONLY_PROMPT,
    }
    code, r = call(engine_server, "/generate", body)
    assert code == 200, r
    tops = r["meta_info"]["input_top_logprobs"]
    _, lp = _reference(model, PROMPT)
    assert len(tops) == len(PROMPT) - 1 and tops[0] is None  # SGLang's: one per listed token, the first None
    for k, row in enumerate(tops[1:], start=1):  # the position predicting token 1 + k
        vals, idx = lp[k].topk(3)
        assert [x[1] for x in row] == idx.tolist() and all(x[2] is None for x in row)
        assert [x[0] for x in row] == pytest.approx(vals.tolist(), abs=1e-5)
    _, r = call(engine_server, "/generate", {**body, "logprob_start_len": -1})
    assert r["meta_info"]["input_top_logprobs"] == [] == r["meta_info"]["input_token_logprobs"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"logprob_start_len": 6}, "logprob_start_len"),  # past the 5 prompt tokens (SGLang aborts it)
        ({"logprob_start_len": -2}, "logprob_start_len"),
        ({"logprob_start_len": "0"}, "logprob_start_len"),
        ({"logprob_start_len": [0, 0]}, "logprob_start_len"),  # two starts for one prompt
        ({"sampling_params": {"stop_regex": ["a+"]}}, "sampling_params.stop_regex"),  # refused, never ignored
        ({"sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ],
)
def test_bad_input_logprob_requests_are_400_naming_the_field(engine_server, call, extra, field):
    code, err = call(engine_server, "/generate", {"input_ids": PROMPT, "return_logprob": True, **extra})
    assert code == 400 and err["param"] == field, err


def test_the_frontends_empty_stop_regex_passes(engine_server, call):
    code, r = call(
        engine_server,
        "/generate",
        {
            "text": "1+2=",
            "sampling_params": {
                "max_new_tokens": 2,
                "ignore_eos": True,  # the untrained model may sample its end token first (CI did once)
                "stop_regex": [],
                "regex": None,
                "json_schema": None,
                "n": 1,
                "top_k": -1,
            },
        },
    )
    assert code == 200 and len(r["output_ids"]) == 2, r


class _NoPromptLogprobs:
    """An engine without the optional ``input_logprobs`` feature."""

    weight_version = 0

    def generate(self, prompts, params):
        from relax_rollout.engines.base import GenerateOutput

        return [GenerateOutput([], [], "length", 0) for _ in prompts]

    def update_weights(self, tensors, version): ...

    def weights_checksum(self):
        return ""


def test_an_engine_without_prompt_logprobs_is_a_400_naming_logprob_start_len(serve, call):
    url = serve(_NoPromptLogprobs(), None)
    body = {"input_ids": PROMPT, "return_logprob": True, "sampling_params": ONLY_PROMPT}
    code, err = call(url, "/generate", {**body, "logprob_start_len": 0})
    assert code == 400 and err["param"] == "logprob_start_len" and "does not implement" in err["message"], err
    code, r = call(url, "/generate", {**body, "logprob_start_len": len(PROMPT)})  # asks for none: answered
    assert code == 200 and r["meta_info"]["input_token_logprobs"] == [], r
