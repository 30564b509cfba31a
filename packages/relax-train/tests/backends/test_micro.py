"""Micro-batches packed by tokens (--use-dynamic-batch-size): the plan, and the same training step as
micro-batches by count (the gradient up to the order of a float sum)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.config_sections import TrainConfig  # noqa: E402
from relax_train.backends.micro import plan_micro_batches  # noqa: E402
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402


def test_by_count_keeps_sample_order():
    assert plan_micro_batches([5] * 5, list(range(5)), TrainConfig(micro_batch_size=2)) == [
        [0, 1],
        [2, 3],
        [4],
    ]


def test_by_tokens_packs_longest_first_within_the_budget():
    train = TrainConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=12)
    lengths = [3, 6, 2, 3, 13, 4]
    plan = plan_micro_batches(lengths, list(range(6)), train)
    assert plan == [[4], [1, 5], [0, 3, 2]]  # 13 alone (over the budget); 2 rows × 6; 3 rows × 3 (+ a 2)
    assert all(len(m) * max(lengths[i] for i in m) <= 12 for m in plan if len(m) > 1)
    assert sorted(i for m in plan for i in m) == list(range(6))
    # only the indices given are planned (one optimizer step's share of the batch)
    assert plan_micro_batches(lengths, [0, 2], train) == [[0, 2]]


def test_dynamic_batch_size_needs_a_token_budget():
    with pytest.raises(ValueError, match="--max-tokens-per-gpu"):
        RelaxConfig.model_validate({"train": {"use_dynamic_batch_size": True}})


def _samples(n: int = 12) -> dict[str, list]:
    rng = np.random.default_rng(0)
    out = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": [], "rollout_log_probs": []}
    for _ in range(n):
        p, r = int(rng.integers(2, 7)), int(rng.integers(1, 6))
        out["tokens"].append(rng.integers(3, 60, size=p + r).astype(np.int64))
        out["prompt_len"].append(p)
        out["loss_mask"].append(np.ones(r, np.float32))
        out["advantages"].append(rng.standard_normal(r).astype(np.float32))
        out["rollout_log_probs"].append(np.full(r, -3.0, np.float32))
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_packed_by_tokens_trains_as_by_count(tiny_model_dir, agg):
    """Samples of 3 to 12 tokens: 3 passes of 4 by count against passes of ≤ 24 padded tokens sorted by
    length. The log-probs, the loss, every gradient and the update agree to float rounding."""

    def backend(train: dict) -> TorchBackend:
        cfg = RelaxConfig.model_validate(
            {
                "train": {"lr": 1e-2, **train},
                "rollout": {"rollout_batch_size": 3, "n_samples_per_prompt": 4},
                "algo": {"loss_agg_mode": agg},
            }
        )
        return TorchBackend(cfg, tiny_model_dir)

    fixed = backend({"micro_batch_size": 4})
    packed = backend({"use_dynamic_batch_size": True, "max_tokens_per_gpu": 24})
    s = _samples()
    for a, b in zip(fixed.compute_log_probs(s), packed.compute_log_probs(s)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    m_fixed, m_packed = fixed.train_step(_samples()), packed.train_step(_samples())
    assert m_packed["loss"] == pytest.approx(m_fixed["loss"], rel=1e-5, abs=1e-7)
    for (name, p), (_, q) in zip(fixed.model.named_parameters(), packed.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
        # Adam's first step is lr * g / (|g| + eps): a gradient near eps moves its weight by up to lr, so
        # float32 summed in another order (another CPU's kernels) shows there; the gradients above carry the
        # comparison, the weights are held to 1% of a step (lr 1e-2)
        torch.testing.assert_close(q, p, rtol=0, atol=1e-4, msg=name)
