"""Delta weight sync to the real SGLang server on this CPU (#53): ``weight_update="delta"`` sends each version
as its difference from the one the engines hold, to our custom loader inside SGLang
(``--custom-weight-loader relax_rollout.sglang_delta_loader.load``), by ``/update_weights_from_tensor``.

Two SGLang 0.5.23 servers serve the tiny Qwen3 checkpoint in float32 for the module. Each version changes 1%
of every tensor's elements (as a bf16 step of AdamW would): what the engines serve is checked against the
same weights in transformers (greedy log-probs), and bitwise: SGLang's own checksum of its parameters
(``/weights_checker``) after the deltas equals the one after it loads the same weights from disk. The misuse of the protocol — a delta on another base, a version cut short, a
bucket out of order or twice — is refused by the loader, the engine keeps serving its last complete version
(its label too), and the next version, full, repairs it.
"""

from __future__ import annotations

import os
import signal

import pytest

torch = pytest.importorskip("torch")

from relax_rollout.engines import sglang_cpu  # noqa: E402
from relax_rollout.engines.base import SamplingParams  # noqa: E402
from relax_rollout.engines.sglang import SGLangEngine  # noqa: E402
from relax_rollout.engines.wire import http_json, model_info  # noqa: E402
from relax_testing import EOS, VOCAB, model_log_probs, wait_until  # noqa: E402

pytestmark = [pytest.mark.real_sglang, pytest.mark.integration]

EOS_ID = VOCAB.index(EOS)
PROMPTS = [[5, 6, 7], [12, 3]]


@pytest.fixture(scope="module")
def real(tiny_model_dir, sglang_python, tmp_path_factory):
    eng = SGLangEngine(
        tiny_model_dir,
        num_engines=2,
        eos_token_ids=[EOS_ID],
        weight_update="delta",
        bucket_bytes=16 << 10,  # (several buckets a version: the order and cut-short cases need them)
        log_dir=str(tmp_path_factory.mktemp("sglang-delta-logs")),
        max_restarts=3,
        poll_interval_s=0.5,
        shutdown_grace_s=5,
        request_timeout_s=120,
        **{**sglang_cpu.engine_kwargs(sglang_python), "gpu_ids": ["0", "1"]},
    )
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def weights(hf):
    """The weights the versions evolve from (the checkpoint's), changed in place by :func:`step`."""
    return {n: p.detach().clone() for n, p in hf.named_parameters()}


def step(weights: dict[str, torch.Tensor], seed: int) -> None:
    """1% of every tensor's elements moved a little (most stay bitwise what they were)."""
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        moved = torch.rand(t.shape, generator=g) < 0.01
        t += moved * 0.05 * torch.randn(t.shape, generator=g)


def _checksum(url: str) -> str:
    got = http_json(url, "/weights_checker", {"action": "checksum"})
    assert got["success"], got
    return str(got["per_engine_checksum"])


def assert_serves(real, hf, weights, version: int, tmp) -> None:
    """Every engine labels ``version`` and serves exactly ``weights``: SGLang's checksum of its parameters is
    the one it has after loading ``weights`` from disk, and greedy log-probs are transformers' with them."""
    from safetensors.torch import save_file

    hf.load_state_dict(weights, strict=False)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / "model.safetensors"))
    for url in real.urls:
        assert model_info(url)["weight_version"] == str(version)
        after_deltas = _checksum(url)
        body = {"model_path": str(tmp), "weight_version": str(version), "flush_cache": True}
        assert http_json(url, "/update_weights_from_disk", body)["success"]
        assert _checksum(url) == after_deltas, f"{url}: version {version} differs from the trainer's weights"
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    for prompt, out in zip(PROMPTS, real.generate(PROMPTS, greedy)):
        assert out.weight_version == version
        assert out.log_probs == pytest.approx(model_log_probs(hf, prompt, out.token_ids), abs=1e-3)


def test_versions_go_as_deltas_and_every_engine_serves_each_one_exactly(real, hf, weights, tmp_path):
    deltas = real.weights.deltas
    full = sum(t.numel() * t.element_size() for t in weights.values())
    real.pauses.drain()
    for v in range(1, 5):
        step(weights, v)
        real.update_weights(dict(weights), v)
        assert_serves(real, hf, weights, v, tmp_path)
        if v == 1:  # the first version goes full (the engines hold the checkpoint, not a version of ours)
            assert deltas.last_sent >= full
        else:
            assert deltas.last_sent < 0.15 * full
    pauses = real.pauses.drain()  # one per update: generation paused around the loader's requests
    assert [v for v, _ in pauses] == [1, 2, 3, 4] and all(s > 0 for _, s in pauses)


def _post_buckets(real, entries, order: list[int]) -> None:
    """The loader's requests for ``entries`` in ``order`` to every engine, by hand, in a session."""
    deltas, tp = real.weights.deltas, real.tp_size
    for url in real.urls:
        http_json(url, "/begin_weight_update", {})
        try:
            body = deltas.body([entries[i] for i in order], url, tp, flush=True)
            assert http_json(url, "/update_weights_from_tensor", body)["success"]
        finally:
            http_json(url, "/end_weight_update", {})


@pytest.mark.parametrize(
    "case, order, why",
    [
        (
            "cut short",
            "first",
            None,
        ),  # (its sender killed after bucket 0: nothing to refuse, nothing committed)
        ("out of order", "swap", "came out of order"),
        ("twice", "repeat", "came twice"),
    ],
)
def test_a_broken_version_is_never_committed_and_the_next_full_one_repairs(
    real, hf, weights, case, order, why, tmp_path
):
    deltas = real.weights.deltas
    held = real.weight_version
    before = {n: t.clone() for n, t in weights.items()}
    step(weights, 100 + len(case))
    entries = deltas.entries(list(weights.items()), held + 1, list(real.urls))
    assert len(entries) >= 3 and entries[1][0]["encoding"] != "full"
    n = len(entries)
    _post_buckets(
        real, entries, {"first": [0], "swap": [1, 0, *range(2, n)], "repeat": [0, 0, *range(1, n)]}[order]
    )
    for url in real.urls:
        version, refused = deltas.held(url, real.tp_size)
        assert version == held and (refused is None if why is None else why in refused)
    assert_serves(real, hf, before, held, tmp_path)  # the last complete version, under its own label
    deltas.codec.ask_full()  # (what SGLangDeltas.send does on a refusal: the next version goes full)
    real.update_weights(dict(weights), held + 2)
    assert_serves(real, hf, weights, held + 2, tmp_path)


def test_a_delta_on_another_base_is_refused_and_the_engines_keep_their_version(real, hf, weights, tmp_path):
    deltas = real.weights.deltas
    held = real.weight_version
    before = {n: t.clone() for n, t in weights.items()}
    real.update_weights(dict(weights), held + 1)  # (a delta: the engines hold what the codec believes)
    assert deltas.codec.held_version == held + 1
    step(weights, 200)
    deltas.codec.held_version = held  # a sender that believes the engines hold an older version
    refused = deltas.send(
        list(weights.items()), held + 2, list(real.urls), real.servers, _session(real), _all(real)
    )
    assert set(refused) == set(real.urls) and all(f"delta on version {held}" in r for r in refused.values())
    assert_serves(real, hf, before, held + 1, tmp_path)
    real.update_weights(dict(weights), held + 3)  # full (asked by the refusal), and every engine takes it
    assert deltas.codec.since_full == 0
    assert_serves(real, hf, weights, held + 3, tmp_path)


def _session(real):
    import contextlib

    @contextlib.contextmanager
    def session(urls):
        for u in urls:
            http_json(u, "/begin_weight_update", {})
        try:
            yield list(urls)
        finally:
            for u in urls:
                http_json(u, "/end_weight_update", {})

    return session


def _all(real):
    def update_all(path, body, urls):
        for u in urls:
            assert http_json(u, path, body(u))["success"]

    return update_all


def test_a_restarted_engine_waits_then_takes_a_full_version_and_deltas_go_on(real, hf, weights, tmp_path):
    """An engine killed and restarted holds the checkpoint, not the last version: it waits out of the pool,
    the next version goes full to every engine (another set of engines), and deltas follow."""
    deltas = real.weights.deltas
    held = real.weight_version
    pids = [s["pid"] for s in real.engines()]
    os.killpg(pids[0], signal.SIGKILL)
    wait_until(lambda: real.engines()[0]["state"] == "waiting", 300, "engine 0 to restart and wait")
    step(weights, 300)
    real.update_weights(dict(weights), held + 1)
    full = sum(t.numel() * t.element_size() for t in weights.values())
    assert deltas.last_sent >= full and len(real.urls) == 2
    assert_serves(real, hf, weights, held + 1, tmp_path)
    step(weights, 301)
    real.update_weights(dict(weights), held + 2)
    assert deltas.last_sent < 0.15 * full
    assert_serves(real, hf, weights, held + 2, tmp_path)
