"""Routing replay (R3) end to end: RolloutWorker (TorchEngine records each token's experts) → DataBus
(``routed_experts``) → TorchBackend (replays them).

The issue's check: the trainer's weights drift from the rollout's (simulated staleness: small noise on every
parameter). Without R3 the trainer routes some token-layer pairs to other experts than the rollout did, and
its log-probs of the sampled tokens move further from the rollout's; with R3 no pair differs and the
log-prob mismatch is smaller. On unperturbed weights, R3 log-probs equal the rollout's.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import RunInputs
from relax_testing import experts_used, tiny_moe

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

torch = pytest.importorskip("torch")

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_inputs(tmp_path_factory):
    """Arithmetic prompts (jsonl) and a tiny Qwen3-MoE checkpoint with a locally trained tokenizer."""
    from relax_app.demo.task import make_arithmetic_task, read_jsonl
    from relax_app.demo.tokenizer import train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("r3")
    files = make_arithmetic_task(root / "task", max_operand=20, n_eval=20)
    rows = read_jsonl(files.train_path)
    tok = train_tokenizer([r["prompt"] + r["label"] for r in rows], root / "model", vocab_size=300)
    tiny_moe(
        LAYERS, TOP_K, vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id
    ).save_pretrained(root / "model")
    return str(root / "model"), str(files.train_path), root


def differing_pairs(used, data) -> int:
    return sum(int((u != r).any(-1).sum()) for u, r in zip(used, data["routed_experts"]))


def mean_abs_logp_gap(logp, data) -> float:
    return float(np.mean(np.abs(np.concatenate(logp) - np.concatenate(data["rollout_log_probs"]))))


@pytest.mark.integration
def test_r3_removes_the_routing_mismatch_of_stale_weights(moe_inputs):
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    ckpt, data_path, root = moe_inputs
    argv = run_flags(
        RunInputs(ckpt, data_path), root / "out", routing_replay=True, rollout_max_response_len=8
    )
    cfg = build_config(None, argv)
    assert cfg.algo.routing_replay
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, ckpt, data_path)
    worker.produce(0)
    data = bus.get("c", 16, timeout=5).data
    assert all(r.shape == (len(t) - 1, LAYERS, TOP_K) for t, r in zip(data["tokens"], data["routed_experts"]))

    trainer = TorchBackend(cfg, ckpt, trainable=False)
    used, logp = experts_used(trainer, data)  # same weights: same experts, same log-probs
    assert differing_pairs(used, data) == 0
    for mine, theirs in zip(data["rollout_log_probs"], logp):
        np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=0)

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # staleness: the trainer's weights have moved on since the rollout
        for p in trainer.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.003)
    with_r3, logp_r3 = experts_used(trainer, data)
    trainer.cfg.algo.routing_replay = False
    without, logp_plain = experts_used(trainer, data)

    pairs = sum(r.shape[0] * LAYERS for r in data["routed_experts"])
    assert differing_pairs(with_r3, data) == 0
    assert 0 < differing_pairs(without, data) < pairs
    gap_r3, gap_plain = mean_abs_logp_gap(logp_r3, data), mean_abs_logp_gap(logp_plain, data)
    assert gap_r3 < gap_plain, (gap_r3, gap_plain)
    print(
        f"differing pairs without R3: {differing_pairs(without, data)}/{pairs}; "
        f"mean |Δ log p|: {gap_r3:.4f} with R3, {gap_plain:.4f} without"
    )


@pytest.mark.integration
def test_r3_covers_every_segment_of_responses_continued_across_updates_in_streaming(moe_inputs, tmp_path):
    """Streaming rollout with partial rollout and R3 (verl #5344 kept only a continued response's last
    segment): each sample carries one routing row per token that went through the engine, the prompt's
    and every segment's, and they are the trainer's own routing of those tokens (same weights published
    at every version here, so any row out of place or missing shows). The per-version exactness of the
    rows of a response continued across a real weight change: tests of ``engines/continuous.py``."""
    from _tiny import stream_in_process

    from relax_train.backends.torch_backend import TorchBackend

    ckpt, data_path, _ = moe_inputs
    flags = dict(
        routing_replay=True,
        n_samples_per_prompt=2,
        rollout_max_response_len=48,
        long_tail_min_tokens=8,
        long_tail_exact=True,
        max_staleness=2,
    )
    cfg = build_config(
        None,
        run_flags(
            RunInputs(ckpt, data_path),
            tmp_path,
            "--fully-async",
            "--streaming-rollout",
            "--partial-rollout",
            **flags,
        ),
    )

    def while_some_generate(k, worker):  # (publish the next version while responses are running)
        deadline = time.monotonic() + 2.0
        while not worker._stream.batcher._running and time.monotonic() < deadline:
            time.sleep(0.001)

    steps, _ = stream_in_process(cfg, ckpt, data_path, 4, between_steps=while_some_generate)
    data = {k: [x for s in steps for x in s[k]] for k in steps[0]}
    versions = [set(v) for v in data["token_versions"]]
    assert any(len(v) > 1 for v in versions), "no response went on across an update"
    for tokens, routed in zip(data["tokens"], data["routed_experts"]):
        assert routed.shape == (len(tokens) - 1, LAYERS, TOP_K) and (routed >= 0).all()
    trainer = TorchBackend(cfg, ckpt, trainable=False)
    cfg.algo.routing_replay = False  # the trainer's own routing, not the replayed
    used, _ = experts_used(trainer, data)
    assert differing_pairs(used, data) == 0
