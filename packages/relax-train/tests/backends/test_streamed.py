"""Streamed training (``backend.streamed_step``, ``backends/streamed.py``): a batch fed part by part as it
arrives, forward and backward per part, one optimizer step at the end, updates the weights as the
whole-batch ``train_step`` does (to 1e-6), in the token-normalised and the sequence-normalised loss modes;
mixing both is refused, and so is a frozen backend."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_train.backends.streamed import streamed_train_step  # noqa: E402
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402

# eight responses of different lengths (vocab of 64; 0 is pad, 1 is eos), advantages of both signs
rng = np.random.default_rng(0)
SEQS = [
    (
        rng.integers(2, 64, int(rng.integers(2, 7))).tolist(),
        rng.integers(2, 64, int(rng.integers(1, 9))).tolist(),
    )
    for _ in range(8)
]


def cfg(**algo) -> RelaxConfig:
    train = {"micro_batch_size": 3, "lr": 1e-3}
    rollout = {"rollout_batch_size": 2, "n_samples_per_prompt": 4, "rollout_max_response_len": 8}
    return RelaxConfig.model_validate({"train": train, "rollout": rollout, "algo": algo})


def samples(idx: list[int]) -> dict:
    out = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": [], "rollout_log_probs": []}
    for k in idx:
        p, r = SEQS[k]
        out["tokens"].append(np.asarray(p + r, dtype=np.int64))
        out["prompt_len"].append(len(p))
        out["loss_mask"].append(np.ones(len(r), dtype=np.float32))
        out["advantages"].append(np.full(len(r), (-1.0) ** k * (0.5 + 0.1 * k), dtype=np.float32))
        out["rollout_log_probs"].append(np.full(len(r), -3.0 - 0.1 * k, dtype=np.float32))
    return out


def grads_at_update(backend) -> list[dict]:
    """The gradients each optimizer step applies (taken just before it writes the weights)."""
    seen: list[dict] = []
    backend.before_update = lambda: seen.append(
        {n: p.grad.detach().clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    )
    return seen


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_a_batch_fed_in_parts_updates_the_weights_as_the_whole_batch_does(tiny_model_dir, mode):
    algo = {"loss_agg_mode": mode, "entropy_coef": 0.01 if mode == "token-mean" else 0.0}
    whole, streamed = TorchBackend(cfg(**algo), tiny_model_dir), TorchBackend(cfg(**algo), tiny_model_dir)
    g_whole, g_streamed = grads_at_update(whole), grads_at_update(streamed)
    for step in range(2):  # (the second step runs on moved weights and AdamW moments)
        want = whole.train_step(samples(list(range(8))))
        # groups as a streaming rollout lands them: out of order, parts of uneven size
        got = streamed_train_step(streamed, [samples([4, 5]), samples([0, 1, 2]), samples([6, 7, 3])])
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7), step
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5), step
        # the same gradient reaches the optimizer (clipped alike), to 1e-6
        for name, g in g_whole[step].items():
            assert float((g - g_streamed[step][name]).abs().max()) <= 1e-6, (step, name)
    assert whole.version == streamed.version == 2
    # and the same weights: AdamW divides each element's gradient by its own scale, so an element whose
    # gradient is at rounding level may move by up to lr (1e-3) either way; at most one in a thousand
    for (name, a), (_, b) in zip(whole.model.named_parameters(), streamed.model.named_parameters()):
        diff = (a - b).abs()
        assert float(diff.max()) <= 1e-3 + 1e-6 and int((diff > 1e-6).sum()) <= max(
            1, diff.numel() // 1000
        ), name


def test_streamed_steps_that_cannot_match_the_whole_batch_are_refused(tiny_model_dir):
    mixed = TorchBackend(cfg(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01), tiny_model_dir)
    with pytest.raises(ValueError, match="--loss-agg-mode token-mean or --entropy-coef 0"):
        mixed.streamed_step(8)
    backend = TorchBackend(cfg(), tiny_model_dir)
    with pytest.raises(ValueError, match="one optimizer step per batch"):
        backend.streamed_step(4)
    step = backend.streamed_step(8)
    step.add(samples([0, 1, 2]))
    with pytest.raises(ValueError, match="ended after 3"):
        step.finish()
    with pytest.raises(RuntimeError, match="built frozen"):
        TorchBackend(cfg(), tiny_model_dir, trainable=False).streamed_step(8)
