"""A request that goes on across a weight update (an in-place pause, as partial rollout does) reports
both versions, as SGLang 0.5.23 does: ``meta_info.weight_versions`` — runs ``{"version", "start", "end"}``
of the generated tokens by the weights that sampled them — and ``weight_version``, the last run's; the
OpenAI routes carry the same in ``metadata``. Each run's log-probs are its own weights' (checked against
a fresh engine of that version), and the client side (``wire.parse_reply``) reads the runs back as per-token versions."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402
from relax_rollout.engines.wire import http_json, parse_reply  # noqa: E402
from relax_rollout.server.served import ServedEngine  # noqa: E402
from relax_testing import SlowEngine, wait_until  # noqa: E402

PROMPT = [3, 12, 4, 13]


@pytest.fixture
def slow_server(tiny_model_dir):
    """A tiny TorchEngine sleeping 50 ms before each decode step, so a request is still decoding when the
    test pauses it."""
    engine = SlowEngine(TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0), 0.05)
    served = ServedEngine(engine)
    yield served.url, engine
    served.close()


def _new_weights(model_dir: str, out_dir) -> dict:
    from safetensors.torch import load_file, save_file

    tensors = load_file(f"{model_dir}/model.safetensors")
    g = torch.Generator().manual_seed(7)
    tensors["lm_head.weight"] = torch.randn(tensors["lm_head.weight"].shape, generator=g)
    save_file(tensors, str(out_dir / "model.safetensors"))
    return tensors


def test_a_request_spanning_an_in_place_update_reports_both_versions(slow_server, tiny_model_dir, tmp_path):
    url, engine = slow_server
    new = _new_weights(tiny_model_dir, tmp_path)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 30, "min_new_tokens": 30, "temperature": 0},
        "return_logprob": True,
    }
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(r=http_json(url, "/generate", body)))
    t.start()
    wait_until(lambda: engine.versions, what="the request decoding")
    time.sleep(0.3)  # a few tokens under version 0
    http_json(url, "/pause_generation", {"mode": "in_place"})  # held between two decode steps
    http_json(url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "1"})
    http_json(url, "/continue_generation", {})
    t.join(60)
    meta = box["r"]["meta_info"]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["0", "1"] and meta["weight_version"] == "1", spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 30
    assert 0 < spans[0]["end"] < 30
    # each run's log-probs are its own weights' (only lm_head changed, so the kept KV cache of the run
    # before is what the new weights would compute too): a fresh engine of each version agrees
    tokens = [tok for _, tok, _ in meta["output_token_logprobs"]]
    got = [lp for lp, _, _ in meta["output_token_logprobs"]]
    k = spans[0]["end"]
    for version, prefix, want in ((0, PROMPT, tokens[:k]), (1, PROMPT + tokens[:k], tokens[k:])):
        fresh = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0)
        if version:
            fresh.update_weights(new, 1)
        n = len(want)
        (ref,) = fresh.generate([prefix], SamplingParams(max_new_tokens=n, min_new_tokens=n, greedy=True))
        assert ref.token_ids == want
        mine = got[:k] if version == 0 else got[k:]
        assert mine == pytest.approx(ref.log_probs, abs=1e-5), version
    (out,) = parse_reply(box["r"], [PROMPT])
    assert out.token_versions == [0] * k + [1] * (30 - k) and out.oldest_version == 0


def test_openai_routes_carry_the_weight_versions_in_metadata(slow_server):
    url, _ = slow_server
    res = http_json(url, "/v1/completions", {"prompt": [PROMPT], "max_tokens": 3, "temperature": 0})
    made = res["usage"]["completion_tokens"]
    assert res["metadata"] == {
        "weight_version": "0",
        "weight_versions": [{"version": "0", "start": 0, "end": made}],
    }
