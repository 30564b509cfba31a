"""TorchEngine: greedy equals a naive argmax loop, sampled log-probs equal the trainer's recomputation
(left padding and temperature included), stop/length, min_new_tokens and weight updates."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_rollout.engines import ENGINES, SamplingParams, build_engine  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402

EOS = 1
# prompts of different lengths, so the batch is left-padded
PROMPTS = [[3, 12, 4, 13], [7, 12, 8, 12, 9, 13], [4, 13], [5, 5, 12, 6, 13]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    return TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)


def naive_greedy(model, prompt, max_new, eos=EOS):
    """No cache, no padding: recompute the whole sequence and take the argmax, token by token."""
    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
            if nxt == eos:
                break
    return out


def test_greedy_is_deterministic_and_equals_naive_loop(engine):
    params = SamplingParams(max_new_tokens=12, greedy=True)
    first = engine.generate(PROMPTS, params)
    second = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    for prompt, out in zip(PROMPTS, first):
        assert out.token_ids == naive_greedy(engine.model, prompt, 12)
        assert len(out.log_probs) == len(out.token_ids)
        assert out.finish_reason == ("stop" if out.token_ids[-1] == EOS else "length")
    # each prompt alone (no padding) gives the same tokens as in the padded batch
    for prompt, out in zip(PROMPTS, first):
        assert engine.generate([prompt], params)[0].token_ids == out.token_ids


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_trainer_recomputation(engine, tiny_model_dir, temperature):
    from relax_core.config import RelaxConfig
    from relax_train.backends.torch_backend import TorchBackend

    prompts = PROMPTS * 2
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=temperature, seed=3))
    cfg = RelaxConfig.model_validate(
        {"rollout": {"rollout_temperature": temperature}, "train": {"micro_batch_size": 8}}
    )
    backend = TorchBackend(cfg, tiny_model_dir, trainable=False)
    samples = {
        "tokens": [np.asarray(p + o.token_ids) for p, o in zip(prompts, outs)],
        "prompt_len": [len(p) for p in prompts],
    }
    recomputed = backend.compute_log_probs(samples)
    assert len({len(o.token_ids) for o in outs}) > 1 or any(o.finish_reason == "length" for o in outs)
    for o, r in zip(outs, recomputed):
        assert len(o.log_probs) == len(o.token_ids) == len(r)
        assert np.max(np.abs(np.asarray(o.log_probs) - r)) <= 1e-4
        assert all(lp <= 0.0 for lp in o.log_probs)


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_new_tokens=8, seed=11)
    a = [o.token_ids for o in engine.generate(PROMPTS, params)]
    b = [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert a == b


def test_finish_reason_stop_and_length(engine):
    greedy_first = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=1, greedy=True))[0].token_ids[
        0
    ]
    stopped = engine.generate(
        [PROMPTS[0]], SamplingParams(max_new_tokens=5, greedy=True, stop_token_ids=(greedy_first,))
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == [greedy_first]  # the stop token is included

    # EOS suppressed for the whole budget: every response runs to the length limit
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, min_new_tokens=6, seed=0))
    for o in outs:
        assert o.finish_reason == "length"
        assert len(o.token_ids) == 6 and EOS not in o.token_ids


def test_min_new_tokens_suppresses_stop_tokens(engine):
    prompt = PROMPTS[1]
    first = engine.generate([prompt], SamplingParams(max_new_tokens=1, greedy=True))[0].token_ids[0]
    keep = next(t for t in range(2, 64) if t != first)
    stops = tuple(t for t in range(64) if t != keep)  # every token but `keep` ends the response

    free = engine.generate([prompt], SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=stops))[0]
    assert free.token_ids == [first] and free.finish_reason == "stop"

    outs = engine.generate(
        [prompt, prompt],
        SamplingParams(max_new_tokens=8, greedy=True, stop_token_ids=stops, min_new_tokens=[0, 3]),
    )
    assert outs[0].token_ids == [first]
    assert outs[1].token_ids[:3] == [keep, keep, keep]
    assert len(outs[1].token_ids) >= 4 or outs[1].finish_reason == "length"


def test_top_logprobs_are_of_the_distribution_sampled_from(engine):
    """k = the whole vocabulary: the alternatives sum to 1 and hold the sampled token at its own log-prob, at a
    temperature (SGLang's: log_softmax(logits / T)) and greedy (log_softmax(logits))."""
    for params in (
        SamplingParams(max_new_tokens=5, temperature=0.7, seed=2, top_logprobs=64),
        SamplingParams(max_new_tokens=5, greedy=True, top_logprobs=64),
    ):
        for out in engine.generate(PROMPTS[:2], params):
            assert len(out.top_logprobs) == len(out.token_ids)
            for t, lp, top in zip(out.token_ids, out.log_probs, out.top_logprobs):
                lps = [x[1] for x in top]
                assert lps == sorted(lps, reverse=True) and sum(np.exp(lps)) == pytest.approx(1.0, abs=1e-4)
                assert dict(top)[t] == pytest.approx(lp, abs=1e-6)
                assert not params.greedy or top[0][0] == t
    assert engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, greedy=True))[0].top_logprobs is None
    few = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, greedy=True, top_logprobs=2))[0]
    assert [len(top) for top in few.top_logprobs] == [2, 2, 2]


def test_stop_strings_end_a_sequence_at_the_token_completing_them(engine):
    """The sequence stops right after its decoded text contains the string (that token kept, matched_stop
    set, finish "stop"); the others of the batch run on as without it."""
    free = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, greedy=True, min_new_tokens=8))
    tok = engine.tokenizer
    stop = tok.decode(free[0].token_ids[2:4])
    assert tok.decode(free[0].token_ids[:3]).find(stop) < 0  # (it first appears with token 3)
    outs = engine.generate(
        PROMPTS, SamplingParams(max_new_tokens=8, greedy=True, min_new_tokens=8, stop=("never-made", stop))
    )
    assert outs[0].token_ids == free[0].token_ids[:4] and outs[0].log_probs == pytest.approx(
        free[0].log_probs[:4]
    )
    assert outs[0].finish_reason == "stop" and outs[0].matched_stop == stop
    for out, ref in zip(outs[1:], free[1:]):
        if stop not in tok.decode(ref.token_ids):
            assert (
                out.token_ids == ref.token_ids and out.matched_stop is None and out.finish_reason == "length"
            )


def test_stop_strings_need_a_tokenizer(tiny_model_dir, engine):
    bare = TorchEngine(model=engine.model, eos_token_ids=[EOS])
    assert "stop" not in bare.features and "top_logprobs" in bare.features
    with pytest.raises(ValueError, match="tokenizer="):
        bare.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, stop=("a",)))
    assert "stop" in engine.features


def test_min_new_tokens_never_emits_eos_early(engine):
    outs = engine.generate(PROMPTS * 3, SamplingParams(max_new_tokens=8, min_new_tokens=5, seed=1))
    for o in outs:
        assert EOS not in o.token_ids[:5]


def test_update_weights_changes_outputs_and_version(tiny_model_dir):
    eng = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)
    params = SamplingParams(max_new_tokens=6, greedy=True)
    before = eng.generate(PROMPTS, params)
    assert eng.weight_version == 0 and all(o.weight_version == 0 for o in before)
    checksum = eng.weights_checksum()

    g = torch.Generator().manual_seed(123)
    new = {n: torch.randn(p.shape, generator=g) for n, p in eng.named_weights() if n.startswith("lm_head")}
    eng.update_weights(new, version=4)
    after = eng.generate(PROMPTS, params)
    assert eng.weight_version == 4 and all(o.weight_version == 4 for o in after)
    assert eng.weights_checksum() != checksum
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert torch.equal(dict(eng.named_weights())["lm_head.weight"], new["lm_head.weight"])


def test_each_weight_update_is_timed_as_the_engines_pause(tiny_model_dir):
    """#53: the time an update holds the engine (no step runs meanwhile) is its pause, per version; the
    rollout drains the longest since its last batch (``longest_pause``), an engine without pauses gives 0."""
    from relax_rollout.engines.pauses import longest_pause

    eng = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)
    new = {n: p.detach().clone() for n, p in eng.named_weights()}
    eng.update_weights(new, version=2)
    eng.update_weights(new, version=3)
    got = eng.pauses.drain()
    assert [v for v, _ in got] == [2, 3] and all(s > 0 for _, s in got)
    assert eng.pauses.drain() == []
    eng.update_weights(new, version=4)
    assert longest_pause(eng) > 0 and longest_pause(eng) == 0.0
    assert longest_pause(object()) == 0.0


def test_update_weights_unknown_name_raises(tiny_model_dir):
    eng = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS])
    with pytest.raises(KeyError, match="not.a.weight"):
        eng.update_weights({"not.a.weight": torch.zeros(1)}, version=1)
    assert eng.weight_version == 0


def test_empty_prompt_list(engine):
    assert engine.generate([], SamplingParams(max_new_tokens=3)) == []


def test_chunks_by_max_batch_size(engine, tiny_model_dir):
    small = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], max_batch_size=3)
    params = SamplingParams(max_new_tokens=5, greedy=True, min_new_tokens=[0, 1, 2, 5])
    outs = small.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in engine.generate(PROMPTS, params)]
    assert len(outs[3].token_ids) == 5  # the 4th prompt's minimum reached the second chunk


def test_build_engine(tiny_model_dir):
    eng = build_engine("torch", model_path=tiny_model_dir)
    assert isinstance(eng, TorchEngine)
    with pytest.raises(ValueError, match="'nope'") as exc:
        build_engine("nope")
    for name in ENGINES:
        assert name in str(exc.value)
    with pytest.raises(ValueError, match="relax-rollout\\[sglang\\]"):
        build_engine("sglang")


def test_engine_needs_a_model():
    with pytest.raises(ValueError, match="model_path or model"):
        TorchEngine()


def test_released_memory_refuses_generation_until_resumed(tiny_model_dir):
    """Colocate: the engine hands its weights' device memory back while the trainer runs; generating or
    updating then is an error that says what to do, and after resuming it generates exactly as before."""
    from relax_rollout.engines.base import MemoryReleased, ReleasesMemory

    eng = TorchEngine(model_path=tiny_model_dir, eos_token_ids=[EOS], pad_token_id=0)
    assert isinstance(eng, ReleasesMemory)
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    before = [o.token_ids for o in eng.generate(PROMPTS, greedy)]
    weights = dict((n, p.detach().clone()) for n, p in eng.named_weights())
    eng.release_memory()
    assert all(p.untyped_storage().nbytes() == 0 for _, p in eng.named_weights())
    with pytest.raises(
        MemoryReleased, match=r"released \(\['cuda_graph', 'kv_cache', 'weights'\]\).*resume_memory"
    ):
        eng.generate(PROMPTS, greedy)
    with pytest.raises(MemoryReleased, match="resume_memory"):
        eng.update_weights(weights, 1)
    eng.resume_memory(["weights"])  # the colocate loop: weights back, updated, then the KV cache
    eng.update_weights(weights, 1)
    with pytest.raises(MemoryReleased, match=r"\['cuda_graph', 'kv_cache'\]"):
        eng.generate(PROMPTS, greedy)
    eng.resume_memory()
    assert [o.token_ids for o in eng.generate(PROMPTS, greedy)] == before
    with pytest.raises(ValueError, match="unknown memory tags \\['vram'\\]"):
        eng.release_memory(["vram"])
