"""TorchEngine(record_routing=True): each output's ``routed_experts`` is the routing a single unpadded
forward over its prompt + response computes (cached decoding, left padding and rows that finish or abort
early included), one entry per token that went through the model."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_rollout.engines import SamplingParams  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402

LAYERS, TOP_K = 2, 2
PROMPTS = [[3, 12, 4, 13], [7, 12, 8, 12, 9, 13, 20, 21], [4, 13], [5, 5, 12, 6, 13]]  # left-padded batch


def tiny_moe(seed=0):
    from relax_testing import tiny_moe as build

    return build(LAYERS, TOP_K, seed)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return TorchEngine(model=tiny_moe(), eos_token_ids=[1], pad_token_id=0, record_routing=True)


def full_forward_routing(engine, seq):
    with torch.no_grad(), engine.routing.record() as rec:
        engine.model(input_ids=torch.tensor([seq]))
    return rec.stacked(0).numpy()


def stop_token_splitting_the_batch(engine, params):
    """A token that ends some rows early while others run to max_new (same seed: same samples)."""
    max_new = params.max_new_tokens
    outs = engine.generate(PROMPTS, params)
    for tok in outs[0].token_ids[1:] + outs[1].token_ids[1:]:
        first = [o.token_ids.index(tok) if tok in o.token_ids else max_new for o in outs]
        if min(first) < max_new - 2 and max(first) == max_new:
            return tok
    pytest.fail("no token splits the batch")


@pytest.mark.parametrize("greedy", [True, False])
def test_recorded_routing_equals_an_unpadded_full_forward(engine, greedy):
    max_new = 8
    params = SamplingParams(max_new_tokens=max_new, greedy=greedy, seed=3)
    stop = stop_token_splitting_the_batch(engine, params)
    outs = engine.generate(PROMPTS, dataclasses.replace(params, stop_token_ids=(stop,)))
    lengths = [len(o.token_ids) for o in outs]
    assert min(lengths) < max_new and max(lengths) == max_new, lengths  # some rows finished early
    for prompt, o in zip(PROMPTS, outs):
        got = o.extra["routed_experts"]
        n = len(prompt) + len(o.token_ids) - 1
        assert got.dtype == np.int16 and got.shape == (n, LAYERS, TOP_K)
        want = full_forward_routing(engine, prompt + o.token_ids)
        np.testing.assert_array_equal(got, want[:n])


def test_aborted_rows_keep_only_their_own_tokens(engine):
    abort_at = {2: {1}, 4: {3}}  # step -> rows aborted before that step's forward
    outs = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=6, greedy=True), on_step=lambda t: abort_at.get(t)
    )
    assert [len(o.token_ids) for o in outs][1] == 2 and outs[1].finish_reason == "abort"
    for prompt, o in zip(PROMPTS, outs):
        n = len(prompt) + len(o.token_ids) - 1
        np.testing.assert_array_equal(
            o.extra["routed_experts"], full_forward_routing(engine, prompt + o.token_ids)[:n]
        )


def test_no_recording_without_the_flag_and_for_dense_models(tiny_model_dir):
    plain = TorchEngine(model=tiny_moe(), eos_token_ids=[1], pad_token_id=0)
    assert plain.routing is None
    assert plain.generate(PROMPTS[:2], SamplingParams(max_new_tokens=3, greedy=True))[0].extra == {}
    dense = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[1], pad_token_id=0, record_routing=True)
    assert dense.routing is None


def test_multimodal_prompts_are_refused_when_recording(engine):
    with pytest.raises(ValueError, match="multimodal"):
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2), mm=[{"pixel_values": torch.zeros(1)}])
