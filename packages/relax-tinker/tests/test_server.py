"""The Tinker API served by relax-tinker, driven by the real ``tinker`` SDK (as a recipe would): a
supervised loop learns; ``forward`` log-probs are our trainer's; an adapter saved through the API loads
with peft; two training clients on one base model train apart; what is not served says so."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
torch = pytest.importorskip("torch")
from tinker import types  # noqa: E402
from tinker_tasks import Server  # noqa: E402

from relax_testing.tinker_task import PROMPT, arithmetic_texts  # noqa: E402


def _datums(tok, texts: list[str]) -> list[types.Datum]:
    """Next-token cross-entropy on the answer (after the prompt), as the cookbook's supervised recipes build."""
    out = []
    for text in texts:
        ids = tok.encode(text)
        n_prompt = len(tok.encode(text[: text.rindex("Assistant:") + len("Assistant:")]))
        weights = [0.0] * (n_prompt - 1) + [1.0] * (len(ids) - n_prompt)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
            )
        )
    return out


def _train(tc, data, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        step.result()
    return losses


@pytest.fixture(scope="module")
def client(server):
    c = tinker.ServiceClient(base_url=server.url)
    yield c
    c.close("success").result()  # (else its heartbeat thread calls the stopped server all session long)


@pytest.fixture(scope="module")
def trained(client, tiny_model):
    """A training client after a short supervised loop, its data and losses (its adapter's initialisation
    seeded: an unseeded one ended this loop at 0.25-0.52 of its first loss, once past the test's 0.7)."""
    tc = client.create_lora_training_client(base_model=tiny_model, rank=8, seed=0)
    data = _datums(tc.get_tokenizer(), arithmetic_texts(16, seed=3))
    return tc, data, _train(tc, data, 8)


def test_a_supervised_loop_lowers_its_loss(trained):
    _, _, losses = trained
    assert losses[-1] < 0.7 * losses[0], losses


def test_forward_log_probs_are_our_trainers_and_the_saved_adapter_loads_with_peft(
    trained, server, tiny_model
):
    from peft import PeftModel

    from relax_core.config import RelaxConfig
    from relax_core.models import load_model
    from relax_core.sample import train_batch
    from relax_train.backends.torch_backend import TorchBackend

    tc, data, _ = trained
    served = [o["logprobs"].tolist() for o in tc.forward(data[:3], "cross_entropy").result().loss_fn_outputs]
    path = tc.save_state("for-peft").result().path
    model_id, kind, name = path.removeprefix("tinker://").split("/")
    saved = server.service.root / model_id / kind / name
    # peft, on its own, from the directory the API wrote
    peft_model = PeftModel.from_pretrained(load_model(tiny_model), str(saved)).eval()
    # our trainer (TorchBackend with the same adapter, log-probs at temperature 1)
    cfg = server.service.adapters.config(model_id)
    run = RelaxConfig.model_validate(
        {
            "rollout": {"rollout_temperature": 1.0},
            "lora": {
                "lora_rank": cfg.r,
                "lora_alpha": cfg.lora_alpha,
                "lora_target_modules": sorted(cfg.target_modules),
            },
        }
    )
    backend = TorchBackend(run, tiny_model, trainable=False, adapter=True)
    backend.load_weights(server.service.adapters.state(model_id), 1)
    for d, lp in zip(data[:3], served):
        tokens = d.model_input.to_ints() + [d.loss_fn_inputs["target_tokens"].tolist()[-1]]
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
        by_peft = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        assert np.allclose(lp, by_peft.numpy(), atol=1e-5)
        ours = backend.compute_log_probs(train_batch({"tokens": [np.array(tokens)], "prompt_len": [1]}))[0]
        assert np.allclose(lp, ours, atol=1e-5), np.abs(np.array(lp) - ours).max()


def test_two_training_clients_on_one_base_model_train_apart(client, server, tiny_model, trained):
    from safetensors.torch import load_file

    tok = trained[0].get_tokenizer()
    a = client.create_lora_training_client(base_model=tiny_model, rank=4)
    b = client.create_lora_training_client(base_model=tiny_model, rank=4)
    data_a = _datums(tok, arithmetic_texts(8, seed=10))
    data_b = _datums(tok, [t.replace("User:", "Q:") for t in arithmetic_texts(8, seed=11)])
    before_a = [o["logprobs"].tolist() for o in a.forward(data_a, "cross_entropy").result().loss_fn_outputs]
    losses_b = _train(b, data_b, 6, lr=3e-3)
    after_b = [o["logprobs"].tolist() for o in a.forward(data_a, "cross_entropy").result().loss_fn_outputs]
    assert after_b == before_a  # b's steps did not touch a's adapter
    losses_a = _train(a, data_a, 6, lr=3e-3)
    assert losses_a[-1] < losses_a[0] and losses_b[-1] < losses_b[0], (losses_a, losses_b)
    saved = []
    for tc in (a, b):
        path = tc.save_weights_for_sampler("apart").result().path
        model_id, kind, name = path.removeprefix("tinker://").split("/")
        saved.append(
            load_file(str(server.service.root / model_id / kind / name / "adapter_model.safetensors"))
        )
    sa, sb = saved
    assert sa.keys() == sb.keys() and any(not torch.equal(sa[k], sb[k]) for k in sa if "lora_" in k)


def test_sampling_follows_the_adapter_saved_and_returns_what_the_cookbook_reads(trained, tiny_model):
    tc = trained[0]
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tok.encode(PROMPT.format(a=3, b=4)))
    params = types.SamplingParams(max_tokens=6, stop=["\n\nUser:"], temperature=1.0)
    out = sampler.sample(prompt, num_samples=3, sampling_params=params, include_prompt_logprobs=True).result()
    assert len(out.sequences) == 3
    for s in out.sequences:
        assert s.logprobs is not None and len(s.logprobs) == len(s.tokens) >= 1
        assert s.stop_reason in ("stop", "length")
        if s.stop_reason == "stop":  # the stop string is in the tokens returned (the cookbook parses it)
            assert tok.decode(s.tokens).endswith("\n\nUser:")
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == prompt.length


def test_what_is_not_served_says_so_in_the_sdks_error_shape(server, client, tiny_model, trained):
    r = httpx.post(server.url + "/api/v1/save_weights_external", json={}, headers={"X-API-Key": "tml-x"})
    assert r.status_code == 404 and "save_weights_external is not served" in r.json()["error"]
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce.*importance_sampling"):
        trained[0].forward_backward(trained[1][:1], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=8).get_info()  # (lazy until used)
    with pytest.raises(tinker.BadRequestError, match="top_k"):
        sampler = trained[0].save_weights_and_get_sampling_client()
        sampler.sample(
            types.ModelInput.from_ints([1, 2]), num_samples=1, sampling_params=types.SamplingParams(top_k=5)
        ).result()


def test_off_loopback_a_token_is_required(tiny_model, tmp_path):
    s = Server(tiny_model, tmp_path, token="tml-secret")
    try:
        denied = httpx.post(s.url + "/api/v1/create_session", json={}, headers={"X-API-Key": "tml-other"})
        allowed = httpx.post(s.url + "/api/v1/create_session", json={}, headers={"X-API-Key": "tml-secret"})
        assert denied.status_code == 401 and allowed.status_code == 200 and allowed.json()["session_id"]
    finally:
        s.close()


def test_the_sampler_in_a_process_of_its_own_takes_adapters_over_dcs_and_fails_alone(tiny_model, tmp_path):
    s = Server(tiny_model, tmp_path, sampler="process")
    try:
        service = tinker.ServiceClient(base_url=s.url)
        tc = service.create_lora_training_client(base_model=tiny_model, rank=4)
        data = _datums(tc.get_tokenizer(), arithmetic_texts(4, seed=5))
        _train(tc, data, 2)
        sampler = tc.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:12])
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4, temperature=1.0)).result()
        # what it sampled, scored by the trainer: the same log-probs (the adapter arrived whole)
        for seq in out.sequences:
            tokens = prompt.to_ints() + seq.tokens
            d = types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:]},
            )
            scored = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
            assert np.allclose(scored[-len(seq.tokens) :], seq.logprobs, atol=1e-5)
        engine = next(iter(s.service.sampling.samplers.values())).engine
        engine.proc.kill()
        engine.proc.wait()
        with pytest.raises(tinker.RequestFailedError, match="engine server exited"):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()
        assert _train(tc, data, 1)  # the training client serves on
        service.close("success").result()
    finally:
        s.close()


def test_a_training_client_made_from_a_saved_state_computes_what_the_saved_one_did(
    trained, client, tiny_model
):
    tc, data, _ = trained
    before = [o["logprobs"].tolist() for o in tc.forward(data[:2], "cross_entropy").result().loss_fn_outputs]
    path = tc.save_state("resume-me").result().path
    again = client.create_training_client_from_state_with_optimizer(path)
    after = [
        o["logprobs"].tolist() for o in again.forward(data[:2], "cross_entropy").result().loss_fn_outputs
    ]
    assert after == before
    assert _train(again, data, 2, lr=1e-3)  # (its optimizer state came along: it steps)


def test_old_results_are_dropped_beyond_the_bound(server, monkeypatch):
    from concurrent.futures import Future

    import relax_tinker.service as service

    monkeypatch.setattr(service, "KEEP_RESULTS", 3)
    svc = server.service
    kept = dict(svc.futures)
    try:
        svc.futures.clear()
        done = []
        for _ in range(5):
            f: Future = Future()
            f.set_result({})
            done.append(svc._track(f))
        assert list(svc.futures) == done[-3:]
    finally:
        svc.futures.clear()
        svc.futures.update(kept)


def test_an_old_sampling_client_samples_its_own_weights_after_they_went_to_disk(
    server, client, tiny_model, monkeypatch
):
    """A loop saving a sampler every step keeps one adapter in memory here (``keep`` 1): the first
    sampling client, its adapter spilled by the second save, still samples exactly what it did."""
    monkeypatch.setattr(server.service.sampling, "keep", 1)
    tc = client.create_lora_training_client(base_model=tiny_model, rank=8)
    data = _datums(tc.get_tokenizer(), arithmetic_texts(8, seed=5))
    _train(tc, data, 1)
    first = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tc.get_tokenizer().encode(PROMPT.format(a=2, b=5)))
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    before = first.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    _train(tc, data, 2)
    second = tc.save_weights_and_get_sampling_client()
    assert len(server.service.sampling.spilled) >= 1  # the first one's adapter went to disk
    second.sample(prompt, num_samples=1, sampling_params=greedy).result()
    again = first.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert again.tokens == before.tokens and again.logprobs == pytest.approx(before.logprobs, abs=1e-5)
