"""LoRA adapter serving (``--lora-sync-mode adapter``) against the real SGLang server on this CPU.

One SGLang 0.5.23 server, launched by :class:`SGLangEngine` with ``lora=`` for the whole module, serves the
tiny Qwen3 checkpoint in float32; the same checkpoint wrapped by peft in this process, with non-zero
``lora_B``, is what its log-probs must equal (the real-SGLang tier's tolerance, 1e-3). The adapter goes
through ``update_weights`` in the wire format (``peft.get_peft_model_state_dict``), as the trainer sends it.
"""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from relax_core.config_lora import LoraConfig  # noqa: E402
from relax_core.lora import peft_config_dict  # noqa: E402
from relax_rollout.engines import sglang_cpu  # noqa: E402
from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.sglang import SGLangEngine  # noqa: E402
from relax_rollout.engines.sglang.lora import adapter_name  # noqa: E402
from relax_rollout.engines.wire import http_json, model_info, version_number  # noqa: E402
from relax_testing import EOS, VOCAB, model_log_probs, wait_until  # noqa: E402

pytestmark = [pytest.mark.real_sglang, pytest.mark.integration]

EOS_ID = VOCAB.index(EOS)
PROMPTS = [[5, 6, 7], [12, 3], [20, 21, 22, 23]]
CONFIG = peft_config_dict(LoraConfig(lora_rank=8, lora_target_modules=["q_proj", "v_proj"]))


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def trained(tiny_model_dir, seed: int):
    """The checkpoint under a peft adapter whose A and B are random (B non-zero: the adapter changes it)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(**CONFIG)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def real(tiny_model_dir, sglang_python, tmp_path_factory):
    eng = SGLangEngine(
        tiny_model_dir,
        eos_token_ids=[EOS_ID],
        weight_update="tensor",  # CUDA IPC, for full weights; an adapter goes by value whatever the mode
        lora=CONFIG,
        log_dir=str(tmp_path_factory.mktemp("sglang-lora-logs")),
        max_restarts=2,
        poll_interval_s=0.5,
        shutdown_grace_s=5,
        request_timeout_s=120,
        **{
            **sglang_cpu.engine_kwargs(sglang_python),
            # as a --partial-rollout run launches them (engine_factory.sglang_kwargs): in-place pauses
            "server_args": {**sglang_cpu.SERVER_ARGS, "disable_overlap_schedule": True},
        },
    )
    yield eng
    eng.close()


def assert_serves(real, model, version: int) -> None:
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert version_number(model_info(real.urls[0])["weight_version"]) == version  # "default": 0
    for prompt, out in zip(PROMPTS, real.generate(PROMPTS, greedy)):
        assert out.weight_version == version and out.token_ids
        assert out.log_probs == pytest.approx(model_log_probs(model, prompt, out.token_ids), abs=1e-3)


def log_probs_without_eos(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """What SGLang reports under ``min_new_tokens``: the distribution with EOS masked out."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logits[:, EOS_ID] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def adapters_loaded(real) -> set[str]:
    return {m["id"] for m in http_json(real.urls[0], "/v1/models")["data"]} - {real.model_path}


def test_an_adapter_replaces_another_and_each_serves_the_peft_model_s_log_probs(real, base, tiny_model_dir):
    assert_serves(real, base, 0)  # version 0: the base model, no adapter
    v1 = trained(tiny_model_dir, 1)
    sent = peft.get_peft_model_state_dict(v1)
    real.update_weights(sent, 1)
    assert_serves(real, v1, 1)
    adapter = sum(t.numel() * t.element_size() for t in sent.values())
    full = sum(t.numel() * t.element_size() for t in base.state_dict().values())
    print(
        f"adapter sync: {real.adapters.last_payload_bytes} B on the wire ({adapter} B of tensors); full: {full} B"
    )
    assert adapter < full / 10 and real.adapters.last_payload_bytes < full / 5  # base64, pickle headers

    v2 = trained(tiny_model_dir, 2)
    real.update_weights(peft.get_peft_model_state_dict(v2), 2)
    assert_serves(real, v2, 2)
    wait_until(lambda: adapters_loaded(real) == {adapter_name(2)}, timeout=30)  # v1 unloaded


def test_a_request_paused_in_place_across_an_update_finishes_with_its_adapter(real, tiny_model_dir):
    """``--partial-rollout``: the held request keeps adapter v3 (its tokens labelled 3) and v3 is unloaded
    only after it finished — an unload sent while it was held would wait for it, blocking every load."""
    v3, v4 = trained(tiny_model_dir, 3), trained(tiny_model_dir, 4)
    real.update_weights(peft.get_peft_model_state_dict(v3), 3)
    started, outs = threading.Event(), []
    long = SamplingParams(max_new_tokens=48, min_new_tokens=48, temperature=0.0)
    t = threading.Thread(
        target=lambda: outs.extend(real.generate([PROMPTS[0]], long, on_token=lambda d: started.set()))
    )
    t.start()
    assert started.wait(60)
    real.pause("in_place")
    try:
        real.update_weights(peft.get_peft_model_state_dict(v4), 4)
        assert adapter_name(3) in adapters_loaded(real)  # still in use
    finally:
        real.resume()
    t.join(120)
    (held,) = outs
    assert held.weight_version == 3 and held.oldest_version == 3 and len(held.token_ids) == 48
    assert held.log_probs == pytest.approx(log_probs_without_eos(v3, PROMPTS[0], held.token_ids), abs=1e-3)
    assert_serves(real, v4, 4)
    wait_until(lambda: adapters_loaded(real) == {adapter_name(4)}, timeout=30)


def test_a_malformed_adapter_is_refused_before_it_reaches_the_server(real, tiny_model_dir):
    sent = peft.get_peft_model_state_dict(trained(tiny_model_dir, 5))
    name = next(n for n in sent if "lora_A" in n)
    with pytest.raises(ValueError, match="rank 4"):
        real.update_weights({**sent, name: sent[name][:4]}, 5)
    with pytest.raises(ValueError, match="not peft's saved name"):
        real.update_weights({"model.layers.0.self_attn.q_proj.weight": sent[name]}, 5)
    assert real.engines()[0]["state"] == "running" and real.engines()[0]["restarts"] == 0


def test_a_killed_engine_restarts_serving_the_adapter_it_held(real, tiny_model_dir):
    """Last (it costs a second server start): the engine's process group is SIGKILLed; the supervisor
    restarts it, and before it serves again it gets the newest adapter (the engine keeps its host copy), so
    requests after the restart see the same policy and version as before it."""
    import os
    import signal

    v6 = trained(tiny_model_dir, 6)
    real.update_weights(peft.get_peft_model_state_dict(v6), 6)
    pids = [s["pid"] for s in real.engines()]
    os.killpg(pids[0], signal.SIGKILL)
    wait_until(
        lambda: all(s["state"] == "running" and s["pid"] not in pids for s in real.engines()),
        300,
        "the engine to restart",
    )
    assert_serves(real, v6, 6)
    assert adapters_loaded(real) == {adapter_name(6)}
