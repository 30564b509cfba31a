"""TorchBackend with --routing-replay: every forward (log-probs and training) routes each token to the
experts in the sample's ``routed_experts`` — even where its own router would choose others — the last token
and padding route normally, replaying its own routing changes nothing, and the router still trains."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402

LAYERS, TOP_K = 2, 2
# prompt + response token ids (vocab of 300), of different lengths: right-padded micro-batches
SEQS = [([3, 12, 4, 13], [5, 6, 1, 40]), ([7, 12, 8, 12, 9, 13], [10]), ([4, 13], [3, 3, 90, 3, 1, 7, 200])]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from relax_testing import tiny_moe

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("moe")
    tiny_moe(LAYERS, TOP_K).save_pretrained(path)
    return str(path)


def make_cfg(replay=True, mbs=2) -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "train": {"micro_batch_size": mbs, "lr": 1e-2},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": len(SEQS)},
            "algo": {"routing_replay": replay},
        }
    )


def routing_of(model, routing, seqs):
    """Per sequence, [len - 1, layers, k] experts of an unpadded forward (what the rollout engine records)."""
    out = []
    for p, r in seqs:
        with torch.no_grad(), routing.record() as rec:
            model(input_ids=torch.tensor([p + r]))
        out.append(rec.stacked(0)[: len(p) + len(r) - 1].numpy())
    return out


def samples_with(routed):
    s = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": [], "routed_experts": routed}
    for k, (p, r) in enumerate(SEQS):
        s["tokens"].append(np.asarray(p + r, dtype=np.int64))
        s["prompt_len"].append(len(p))
        s["loss_mask"].append(np.ones(len(r), dtype=np.float32))
        s["advantages"].append(np.full(len(r), 1.0 - k, dtype=np.float32))
    return s


def stale_routing(be, scale=0.05):
    """The routing of a perturbed copy of the weights (a stale rollout policy)."""
    saved = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in be.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
        routed = routing_of(be.model, be.routing, SEQS)
        for n, p in be.model.named_parameters():
            p.copy_(saved[n])
    return routed


def used_experts(be, samples):
    """Per sample, the experts the backend's forwards used for its first len - 1 tokens."""
    with be.routing.record() as rec:
        lp = be.compute_log_probs(samples)
    mbs, out = be.cfg.train.micro_batch_size, []
    for f in range(len(rec.forwards)):
        idx = list(range(f * mbs, min(len(SEQS), (f + 1) * mbs)))
        width = max(len(samples["tokens"][i]) for i in idx)
        fw = rec.stacked(f).view(len(idx), width, LAYERS, TOP_K).numpy()
        out.extend(fw[row, : len(samples["tokens"][i]) - 1] for row, i in enumerate(idx))
    return out, lp


@pytest.mark.parametrize("mbs", [1, 2])
def test_log_probs_use_exactly_the_replayed_experts(moe_dir, mbs):
    be = TorchBackend(make_cfg(mbs=mbs), moe_dir, trainable=False)
    assert (be.routing.num_layers, be.routing.top_k) == (LAYERS, TOP_K)
    routed = stale_routing(be)
    used, _ = used_experts(be, samples_with(routed))
    for u, r in zip(used, routed):
        np.testing.assert_array_equal(u, r)
    # the trainer's own router disagrees with the stale routing somewhere: replay was not a no-op
    be.cfg.algo.routing_replay = False
    natural, _ = used_experts(be, samples_with(routed))
    assert any((n != r).any() for n, r in zip(natural, routed))


def test_replaying_its_own_routing_changes_no_log_prob(moe_dir):
    be = TorchBackend(make_cfg(replay=False), moe_dir, trainable=False)
    own = routing_of(be.model, be.routing, SEQS)
    plain = be.compute_log_probs(samples_with(own))
    be.cfg.algo.routing_replay = True
    with_r3 = be.compute_log_probs(samples_with(own))
    for a, b in zip(plain, with_r3):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_train_step_replays_reports_and_trains_the_router(moe_dir):
    be = TorchBackend(make_cfg(), moe_dir)
    samples = samples_with(stale_routing(be))
    samples["rollout_log_probs"] = be.compute_log_probs(samples)
    gates = [b.gate.weight.detach().clone() for b in be.routing.blocks]
    m = be.train_step(samples)
    assert m["r3_replayed_frac"] == 1.0
    assert 0.0 < m["r3_expert_differ_frac"] < 1.0
    assert all(not torch.equal(g, b.gate.weight) for g, b in zip(gates, be.routing.blocks))
    be.cfg.algo.routing_replay = False
    assert "r3_replayed_frac" not in be.train_step(samples)


def test_routing_from_another_model_shape_is_refused(moe_dir):
    be = TorchBackend(make_cfg(), moe_dir, trainable=False)
    wrong = [np.zeros((len(p) + len(r) - 1, LAYERS + 1, TOP_K), dtype=np.int16) for p, r in SEQS]
    with pytest.raises(ValueError, match="MoE layers"):
        be.compute_log_probs(samples_with(wrong))
