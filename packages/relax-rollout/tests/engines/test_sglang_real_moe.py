"""A Mixture-of-Experts model on the real SGLang server (CPU): per-expert weight updates.

One SGLang 0.5.23 server serves a tiny Qwen3-MoE checkpoint in float32 (SGLang's torch-native MoE on a CPU
without AMX). A weight update sent as the trainers export it (experts fused) loads: SGLang's loader takes
experts one module each and skips fused names without an error, so the log-probs after the update are the
new model's only if every expert arrived.

The server runs as a --partial-rollout run launches it (no overlap scheduler, no prefix cache), and an
update under an in-place pause is checked to leave no KV of the old weights behind.

Not here: routed experts (R3, ``--enable-return-routed-experts``). SGLang 0.5.23 pins its host buffer for
them with ``cudaHostRegister`` even with ``--device cpu``, so the server cannot start with it on a machine
without CUDA; the reply format is tested against our engine server (test_sglang.py) and waits for a GPU.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines import sglang_cpu  # noqa: E402
from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.sglang import SGLangEngine  # noqa: E402
from relax_testing import EOS, VOCAB, model_log_probs, tiny_moe  # noqa: E402

pytestmark = [pytest.mark.real_sglang, pytest.mark.integration]

PROMPTS = [[5, 6, 7], [12, 3], [20, 21, 22, 23]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


PARTIAL_ROLLOUT = [
    *("--prompt-data", "p", "--hf-checkpoint", "m", "--rollout-backend", "sglang", "--rollout-num-gpus", "1"),
    *("--fully-async", "--streaming-rollout", "--partial-rollout"),
]


def launched_as_partial_rollout() -> dict:
    """SGLang's launch flags on this CPU as a --partial-rollout run sets them (``engine_factory``): the
    overlap scheduler off (exact per-token versions across an in-place pause) and the prefix cache off (an
    update under an in-place pause cannot flush it)."""
    from relax_app.cli_config import build_config
    from relax_rollout.engine_factory import sglang_kwargs

    server_args = sglang_kwargs(build_config(None, PARTIAL_ROLLOUT))["server_args"]
    assert server_args == {"disable_overlap_schedule": True, "disable_radix_cache": True}
    return {**sglang_cpu.SERVER_ARGS, **server_args}


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory) -> str:
    moe = tmp_path_factory.mktemp("moe")
    tiny_moe(moe_intermediate_size=16).save_pretrained(moe)
    for f in Path(tiny_model_dir).iterdir():  # its tokenizer (64 of the model's 300 ids)
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy2(f, moe / f.name)
    return str(moe)


@pytest.fixture(scope="module")
def real(moe_dir, sglang_python, tmp_path_factory):
    eng = SGLangEngine(
        moe_dir,
        num_engines=1,
        eos_token_ids=[VOCAB.index(EOS)],
        weight_update="distributed",
        bucket_bytes=4096,
        log_dir=str(tmp_path_factory.mktemp("sglang-moe-logs")),
        request_timeout_s=120,
        **{**sglang_cpu.engine_kwargs(sglang_python), "server_args": launched_as_partial_rollout()},
    )
    yield eng
    eng.close()


def assert_served_by(real, model) -> None:
    for prompt, out in zip(PROMPTS, real.generate(PROMPTS, GREEDY)):
        assert out.token_ids and out.log_probs == pytest.approx(
            model_log_probs(model, prompt, out.token_ids), abs=1e-3
        )


def test_serves_the_moe_model(real, moe_dir):
    from transformers import AutoModelForCausalLM

    assert_served_by(real, AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval())


@pytest.mark.parametrize("path", ["distributed", "disk"])
def test_a_fused_expert_update_loads(real, path):
    """The trainers' fused experts go one module per expert (4 KiB buckets: a layer's experts span several;
    the version only on the last), and SGLang then serves the new model."""
    new = tiny_moe(seed={"distributed": 1, "disk": 2}[path], moe_intermediate_size=16).eval()
    version = real.weight_version + 1
    sent, call = [], real.servers.call

    def spy(url, route, body=None, timeout_s=None):  # what went on the wire
        if route in ("/update_weights_from_distributed", "/update_weights_from_disk"):
            sent.append(body)
        return call(url, route, body, timeout_s)

    real.servers.call, real.weight_update = spy, path
    try:
        real.update_weights(dict(new.state_dict()), version)
    finally:
        real.servers.call, real.weight_update = call, "distributed"
    if path == "disk":
        from safetensors import safe_open

        with safe_open(Path(real.pool.weights_path) / "model.safetensors", "pt") as f:
            names = set(f.keys())
    else:
        assert len(sent) > 10 and {b["load_format"] for b in sent} == {"flattened_bucket"}
        assert [b.get("weight_version") for b in sent] == [None] * (len(sent) - 1) + [str(version)]
        names = {n for b in sent for n in b["names"]}
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names)
    real.check_weight_version(version)
    assert_served_by(real, new)


def test_a_disk_update_under_an_in_place_pause_goes_in_and_no_prompt_is_served_from_old_kv(real, monkeypatch):
    """Partial rollout's update with ``weight_update="disk"`` (the default): SGLang refuses to flush its cache
    while requests are paused in place (HTTP 400, which failed every engine), so the update is sent without
    the flush. With SGLang's prefix cache on, a prompt served before would then be served from KV of the old
    weights under the new version (measured: a log-prob off by 3.1 nats): a --partial-rollout run launches
    SGLang without it, as this engine is. Every layer changes here, so stale KV would show."""
    import threading

    from relax_rollout.engines.wire import http_json

    monkeypatch.setattr(real, "weight_update", "disk")
    before = real.weight_version
    real.generate(PROMPTS, GREEDY)  # the prompts go through the engine once
    pids = [s["pid"] for s in real.engines()]
    new = tiny_moe(seed=4, moe_intermediate_size=16).eval()
    long = SamplingParams(max_new_tokens=60, temperature=1.0, min_new_tokens=60)
    box: dict = {}
    for url in real.urls:
        http_json(url, "/slow_down", {"forward_sleep_time": 0.03})
    try:
        t = threading.Thread(target=lambda: box.update(out=real.generate(PROMPTS[:2], long)))
        t.start()
        threading.Event().wait(0.6)  # the requests are decoding
        real.pause("in_place")
        try:
            real.update_weights(dict(new.state_dict()), before + 1)
        finally:
            real.resume()
        t.join(120)
    finally:
        for url in real.urls:
            http_json(url, "/slow_down", {"forward_sleep_time": None})
    for out in box["out"]:  # held, then gone on under the new weights
        assert out.finish_reason == "length" and set(out.token_versions) == {before, before + 1}, out
    assert [s["pid"] for s in real.engines()] == pids
    real.check_weight_version(before + 1)
    assert_served_by(real, new)


def test_user_launched_sglang_with_the_partial_rollout_flags_passes_the_check(real, caplog):
    """The same check on a server launched without the prefix cache and the overlap scheduler (what
    test_sglang_real.py's engines, with the cache on, fail): nothing refused, nothing warned."""
    from relax_rollout.engines.external import ExternalEngine

    ExternalEngine(urls=real.urls).check_partial_rollout()
    assert "partial-rollout" not in caplog.text
