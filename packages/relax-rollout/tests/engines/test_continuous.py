"""Continuous batching (``engines/continuous.py``): each request's tokens and log-probs are what it gets
generated alone, whatever runs beside it and whenever it joins; a short request leaves before a long one
started earlier; weights updated between decode steps stamp each token with its version, and each
version's span has that version's log-probs (partial rollout's engine half)."""

import time
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_rollout.engines import SamplingParams  # noqa: E402
from relax_rollout.engines.continuous import ContinuousBatcher  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402

EOS = 1
PROMPTS = [[3, 12, 4, 13], [7, 12, 8, 12, 9, 13], [4, 13], [5, 5, 12, 6, 13], [9, 9], [6, 12, 7, 13, 8]]


@pytest.fixture
def engine(tiny_model_dir):
    return TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)


@pytest.fixture
def batcher(engine):
    b = ContinuousBatcher(engine, max_running=3)
    yield b
    b.close()


def log_probs(model, prompt: list[int], tokens: list[int], temperature: float) -> list[float]:
    """Teacher-forced log-probs of ``tokens`` after ``prompt`` (one forward, no cache, no padding), the end
    token blocked (the requests here ask for all their tokens: min_new_tokens = max_new_tokens)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logits[:, EOS] = float("-inf")
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def across_an_update(batcher, new: dict, n: int, seed: int) -> list:
    """Three requests of ``n`` sampled tokens each (temperature 1), ``new`` loaded as version 1 after ten
    decode steps; their outputs."""
    params = SamplingParams(max_new_tokens=n, min_new_tokens=n, temperature=1.0, seed=seed)
    futures = [batcher.submit(p, replace(params, seed=seed + i)) for i, p in enumerate(PROMPTS[:3])]
    while batcher.steps < 10:
        time.sleep(0.001)
    batcher.update_weights(new, version=1)
    return [f.result(timeout=60) for f in futures]


@pytest.mark.parametrize("sampling", ["greedy", "top_p"])
def test_each_request_gets_what_it_would_get_alone(engine, batcher, sampling):
    """Six requests of different lengths through three running slots (so later ones join while others
    decode, and each leaves at its own length): each equals the batch engine generating that prompt alone
    with the same seed."""
    base = (
        SamplingParams(max_new_tokens=14, greedy=True)
        if sampling == "greedy"
        else SamplingParams(max_new_tokens=14, temperature=0.9, top_p=0.9, seed=5)
    )
    lengths, mins = [14, 5, 9, 3, 12, 7], [0, 5, 2, 0, 12, 4]
    params = [
        replace(base, max_new_tokens=n, min_new_tokens=m, seed=None if base.seed is None else base.seed + i)
        for i, (n, m) in enumerate(zip(lengths, mins))
    ]
    outs = [f.result(timeout=60) for f in [batcher.submit(x, p) for x, p in zip(PROMPTS, params)]]
    assert batcher.peak_running == 3
    for i, (prompt, p, out) in enumerate(zip(PROMPTS, params, outs)):
        alone = engine.generate([prompt], p)[0]
        assert out.token_ids == alone.token_ids, i
        assert out.log_probs == pytest.approx(alone.log_probs, abs=1e-5), i
        assert out.finish_reason == alone.finish_reason and mins[i] <= len(out.token_ids) <= lengths[i]
        assert out.token_versions == [0] * len(out.token_ids)
    assert len({len(o.token_ids) for o in outs}) > 2  # rows left at different steps


def test_generate_seeds_request_i_with_seed_plus_i(batcher):
    params = SamplingParams(max_new_tokens=6, seed=3, min_new_tokens=[6, 2])
    outs = batcher.generate(PROMPTS[:2], params)
    one = [
        batcher.submit(x, replace(params, seed=3 + i, min_new_tokens=m))
        for i, (x, m) in enumerate(zip(PROMPTS, [6, 2]))
    ]
    assert [o.token_ids for o in outs] == [f.result(timeout=60).token_ids for f in one]


def test_a_short_request_leaves_before_a_long_one_started_earlier(batcher):
    long = batcher.submit(PROMPTS[0], SamplingParams(max_new_tokens=60, min_new_tokens=60, seed=1))
    while batcher.steps < 3:
        time.sleep(0.001)
    short = batcher.submit(PROMPTS[1], SamplingParams(max_new_tokens=3, seed=2))
    assert len(short.result(timeout=60).token_ids) == 3
    assert not long.done()  # joined after it, finished before it
    assert len(long.result(timeout=60).token_ids) == 60


def test_weights_updated_between_decode_steps_stamp_each_token_with_its_version(
    engine, batcher, tiny_model_dir
):
    """The update goes in between two decode steps of running requests: their tokens before it carry
    version 0 and the old model's log-probs, the tokens after it version 1 and the new model's. (Only the
    output head changes here, so the KV cache the requests keep is the new model's too, and the log-probs
    compare exactly with a fresh forward.)"""
    from relax_core.models import load_model

    old = load_model(tiny_model_dir, "float32").eval()
    g = torch.Generator().manual_seed(123)
    new = {n: 0.5 * torch.randn(p.shape, generator=g) for n, p in engine.named_weights() if "lm_head" in n}
    N = 150  # (long enough that the update lands mid-request on a loaded machine)
    outs = across_an_update(batcher, new, N, seed=7)
    for prompt, out in zip(PROMPTS, outs):
        k = out.token_versions.index(1)
        assert 0 < k < N and out.token_versions == [0] * k + [1] * (N - k)
        assert out.weight_version == 1
        want_old = log_probs(old, prompt, out.token_ids, 1.0)[:k]
        want_new = log_probs(engine.model, prompt, out.token_ids, 1.0)[k:]
        assert out.log_probs[:k] == pytest.approx(want_old, abs=1e-4)
        assert out.log_probs[k:] == pytest.approx(want_new, abs=1e-4)
        assert abs(out.log_probs[k] - log_probs(old, prompt, out.token_ids, 1.0)[k]) > 1e-3  # (it changed)


def test_requests_the_batcher_cannot_serve_are_refused_with_the_reason(batcher):
    with pytest.raises(ValueError, match="top_logprobs"):
        batcher.submit(PROMPTS[0], SamplingParams(max_new_tokens=4, top_logprobs=2))
    with pytest.raises(ValueError, match="stop"):
        batcher.submit(PROMPTS[0], SamplingParams(max_new_tokens=4, stop=("ab",)))
    with pytest.raises(ValueError, match="empty prompt"):
        batcher.submit([], SamplingParams(max_new_tokens=4))


def test_closing_fails_the_requests_in_flight_loudly(engine):
    b = ContinuousBatcher(engine, max_running=1)
    running = b.submit(PROMPTS[0], SamplingParams(max_new_tokens=500, min_new_tokens=500, seed=1))
    waiting = b.submit(PROMPTS[1], SamplingParams(max_new_tokens=5, seed=1))
    while b.steps < 2:
        time.sleep(0.001)
    b.close()
    for f in (running, waiting):
        with pytest.raises(RuntimeError, match="closed before it finished"):
            f.result(timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        b.submit(PROMPTS[0], SamplingParams(max_new_tokens=5))


def test_a_draining_update_waits_for_the_running_and_holds_the_waiting(engine, batcher):
    """Without partial rollout: the update goes in once the running requests end (all their tokens of the
    old version), and a request submitted meanwhile starts only under the new weights."""
    import threading

    g = torch.Generator().manual_seed(5)
    new = {n: 0.5 * torch.randn(p.shape, generator=g) for n, p in engine.named_weights() if "lm_head" in n}
    first = batcher.submit(PROMPTS[0], SamplingParams(max_new_tokens=80, min_new_tokens=80, seed=1))
    while batcher.steps < 3:
        time.sleep(0.001)
    update = threading.Thread(target=batcher.update_weights, args=(new, 1), kwargs={"drain": True})
    update.start()
    while not batcher._updates:
        time.sleep(0.001)
    later = batcher.submit(PROMPTS[1], SamplingParams(max_new_tokens=5, seed=2))
    update.join(60)
    assert first.result(timeout=60).token_versions == [0] * 80
    assert later.result(timeout=60).token_versions == [1] * 5


def test_routing_is_recorded_for_every_segment_of_a_response_continued_across_an_update():
    """R3 with partial rollout (verl #5344 kept only the last segment): a response continued across an
    update carries one routing row per token that went through the model — the prompt's and the segment
    before the update under the old router, the segment after it under the new one. Only the last MoE
    layer's router changes, so every earlier layer and every cached key / value is the same under both
    versions, and each segment compares exactly with a full forward of its version's model."""
    import numpy as np

    from relax_testing import tiny_moe

    engine = TorchEngine(
        model=tiny_moe(2, 2, seed=0), eos_token_ids=[EOS], pad_token_id=0, record_routing=True
    )
    old = tiny_moe(2, 2, seed=0).eval()
    gate = engine.routing.blocks[-1].gate
    name = next(n for n, p in engine.model.named_parameters() if p is gate.weight)
    g = torch.Generator().manual_seed(9)
    new = {name: 3.0 * torch.randn(gate.weight.shape, generator=g)}

    def routing(model, seq):
        from relax_core.routing import install_routing

        with torch.no_grad(), install_routing(model).record() as rec:
            model(input_ids=torch.tensor([seq]))
        return rec.stacked(0).numpy()

    b = ContinuousBatcher(engine, max_running=3)
    try:
        N = 120
        outs = across_an_update(b, new, N, seed=3)
    finally:
        b.close()
    for prompt, out in zip(PROMPTS, outs):
        k = out.token_versions.index(1)  # token k is the first sampled under version 1 ...
        assert 0 < k < N
        got = out.extra["routed_experts"]
        P = len(prompt)
        assert got.shape == (P + N - 1, 2, 2)
        cut = P + k - 1  # ... by the decode step feeding token k - 1, routing row P + k - 1
        seq = prompt + out.token_ids
        want_old, want_new = routing(old, seq), routing(engine.model, seq)
        np.testing.assert_array_equal(got[:cut], want_old[:cut])
        np.testing.assert_array_equal(got[cut:], want_new[cut : P + N - 1])
        assert (want_old[cut : P + N - 1] != want_new[cut : P + N - 1]).any()  # (the router did change)
