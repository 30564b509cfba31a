"""TorchBackend: log-probs equal a direct computation, training moves weights the right way, checkpoints
round-trip."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402

# prompt + response token ids (vocab of 64; 0 is pad, 1 is eos), of different lengths
SEQS = [([3, 12, 4, 13], [5, 6, 1]), ([7, 12, 8, 12, 9, 13], [10]), ([4, 13], [3, 3, 3, 3, 1])]


def make_cfg(**kw) -> RelaxConfig:
    t = {
        "micro_batch_size": kw.pop("micro_batch_size", 2),
        "lr": kw.pop("lr", 1e-3),
        "weight_decay": kw.pop("weight_decay", 0.0),  # (a step with no gradient must leave the weights alone)
    }
    r = {
        "rollout_temperature": kw.pop("temperature", 1.0),
        "rollout_batch_size": 1,
        "n_samples_per_prompt": kw.pop("n", len(SEQS)),
    }
    return RelaxConfig.model_validate({"train": t, "rollout": r, "algo": kw})


def make_samples(seqs=SEQS, advantages=None):
    samples = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": []}
    for k, (p, r) in enumerate(seqs):
        samples["tokens"].append(np.asarray(p + r, dtype=np.int64))
        samples["prompt_len"].append(len(p))
        samples["loss_mask"].append(np.ones(len(r), dtype=np.float32))
        a = 0.0 if advantages is None else advantages[k]
        samples["advantages"].append(np.full(len(r), a, dtype=np.float32))
    return samples


def manual_log_probs(model, seqs, temperature):
    out = []
    with torch.no_grad():
        for p, r in seqs:
            ids = torch.tensor([p + r])
            logits = model(input_ids=ids).logits[0].double() / temperature
            logp = torch.log_softmax(logits, -1)
            out.append(np.array([float(logp[len(p) - 1 + j, r[j]]) for j in range(len(r))]))
    return out


def weights(backend):
    return {n: p.detach().clone() for n, p in backend.model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mbs", [1, 2, 8])
def test_compute_log_probs_equals_manual(tiny_model_dir, temperature, mbs):
    be = TorchBackend(
        make_cfg(temperature=temperature, micro_batch_size=mbs), tiny_model_dir, trainable=False
    )
    got = be.compute_log_probs(make_samples())
    ref = manual_log_probs(be.model, SEQS, temperature)
    assert len(got) == len(SEQS)
    for g, r, (_, resp) in zip(got, ref, SEQS):
        assert g.dtype == np.float32 and g.shape == (len(resp),)
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_compute_log_probs_keeps_training_mode(tiny_model_dir):
    be = TorchBackend(make_cfg(), tiny_model_dir, trainable=True)
    be.compute_log_probs(make_samples())
    assert be.model.training


def test_train_step_changes_weights_and_returns_finite_metrics(tiny_model_dir):
    be = TorchBackend(make_cfg(), tiny_model_dir)
    samples = make_samples(advantages=[1.0, -1.0, 0.5])
    samples["rollout_log_probs"] = be.compute_log_probs(samples)
    before = weights(be)
    metrics = be.train_step(samples)
    after = weights(be)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for key in ("loss", "pg_loss", "clipfrac", "ratio_mean", "grad_norm", "optimizer_steps"):
        assert np.isfinite(metrics[key]), key
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # old log-probs are the current ones
    assert metrics["grad_norm"] > 0
    assert metrics["optimizer_steps"] == 1.0
    assert metrics["lr"] == be.cfg.train.lr  # (the trainer logs it as train/lr)
    assert be.version == 1


def test_global_batch_size_splits_optimizer_steps(tiny_model_dir):
    cfg = RelaxConfig.model_validate(
        {
            "train": {"micro_batch_size": 1, "global_batch_size": 2},
            "rollout": {"rollout_batch_size": 2, "n_samples_per_prompt": 2},
        }
    )
    be = TorchBackend(cfg, tiny_model_dir)
    seqs = SEQS + [([5, 13], [6, 1])]
    samples = make_samples(seqs, advantages=[1.0, -1.0, 0.5, -0.5])
    samples["log_probs"] = be.compute_log_probs(samples)
    assert be.train_step(samples)["optimizer_steps"] == 2.0


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_log_prob(tiny_model_dir, sign):
    be = TorchBackend(make_cfg(n=2, lr=1e-3), tiny_model_dir)
    seqs = SEQS[:2]
    samples = make_samples(seqs, advantages=[sign, 0.0])
    samples["log_probs"] = be.compute_log_probs(samples)
    before = float(np.sum(samples["log_probs"][0]))
    be.train_step(samples)
    after = float(np.sum(be.compute_log_probs(samples)[0]))
    assert (after - before) * sign > 0, (before, after)


def test_loss_mask_zero_means_no_update(tiny_model_dir):
    be = TorchBackend(make_cfg(), tiny_model_dir)
    samples = make_samples(advantages=[1.0, -1.0, 0.5])
    samples["loss_mask"] = [np.zeros_like(m) for m in samples["loss_mask"]]
    samples["log_probs"] = be.compute_log_probs(samples)
    before = weights(be)
    be.train_step(samples)
    after = weights(be)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_a_non_finite_gradient_never_reaches_the_weights(tiny_model_dir, poison):
    """Whatever slipped past the reward check (an advantage, an overflow) and made the gradient NaN or inf:
    the step is skipped and counted, the weights and AdamW's moments stay as they were, training goes on."""
    be = TorchBackend(make_cfg(), tiny_model_dir)
    samples = make_samples(advantages=[1.0, poison, 0.5])
    samples["log_probs"] = be.compute_log_probs(samples)
    before = weights(be)
    metrics = be.train_step(samples)
    assert all(torch.equal(before[n], w) for n, w in weights(be).items())
    assert metrics["nonfinite_updates_skipped"] == 1.0 and not np.isfinite(metrics["grad_norm"])
    good = make_samples(advantages=[1.0, -1.0, 0.5])
    good["log_probs"] = be.compute_log_probs(good)
    metrics = be.train_step(good)
    assert metrics["nonfinite_updates_skipped"] == 0.0
    after = weights(be)
    assert all(torch.isfinite(w).all() for w in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_frozen_backend_cannot_train(tiny_model_dir):
    be = TorchBackend(make_cfg(), tiny_model_dir, trainable=False)
    with pytest.raises(RuntimeError, match="frozen"):
        be.train_step(make_samples())


def test_checkpoint_round_trip(tiny_model_dir, tmp_path):
    be = TorchBackend(make_cfg(), tiny_model_dir)
    samples = make_samples(advantages=[1.0, -1.0, 0.5])
    samples["log_probs"] = be.compute_log_probs(samples)
    be.train_step(samples)
    saved = weights(be)
    be.save_checkpoint(tmp_path / "ckpt")

    be.train_step(samples)
    assert be.version == 2
    assert any(not torch.equal(saved[n], p) for n, p in weights(be).items())

    meta = be.load_checkpoint(tmp_path / "ckpt")
    assert meta == {"version": 1}
    assert be.version == 1
    for n, p in weights(be).items():
        assert torch.equal(saved[n], p), n

    fresh = TorchBackend(make_cfg(), tiny_model_dir)
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.version == 1
    for n, p in weights(fresh).items():
        assert torch.equal(saved[n], p), n
    # the optimizer state came back too: the next step from either copy is identical
    be.train_step(samples)
    fresh.train_step(samples)
    for (n, a), (_, b) in zip(weights(be).items(), weights(fresh).items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=n)


def test_a_checkpoint_lacking_tensors_is_refused_not_half_loaded(tiny_model_dir, tmp_path):
    """Loading took whatever tensors were there (strict=False, for tied weights) and trained on: a checkpoint
    missing half its tensors went unnoticed. Only a tied weight saved under its other name may be absent."""
    from safetensors.torch import load_file, save_file

    tied = TorchBackend(make_cfg(), tiny_model_dir)
    tied.save_checkpoint(tmp_path / "ckpt")
    tied.load_checkpoint(tmp_path / "ckpt")  # whole (the tiny model ties its embeddings): loads
    st = tmp_path / "ckpt" / "model" / "model.safetensors"
    tensors = load_file(str(st))
    kept = dict(list(tensors.items())[: len(tensors) // 2])
    save_file(kept, str(st), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lacks {len(tensors) - len(kept)} of the model's tensors"):
        TorchBackend(make_cfg(), tiny_model_dir).load_checkpoint(tmp_path / "ckpt")


def test_load_checkpoint_missing_is_clear(tiny_model_dir, tmp_path):
    be = TorchBackend(make_cfg(), tiny_model_dir)
    with pytest.raises(FileNotFoundError, match="meta.json"):
        be.load_checkpoint(tmp_path)


def test_load_weights_sets_version(tiny_model_dir):
    be = TorchBackend(make_cfg(), tiny_model_dir, trainable=False)
    name, p = be.named_weights()[0]
    be.load_weights({name: torch.zeros_like(p)}, version=7)
    assert be.version == 7
    assert torch.count_nonzero(dict(be.model.named_parameters())[name]) == 0


def test_offload_frees_the_trainer_and_training_continues_bit_for_bit(tiny_model_dir):
    """Colocate ``--offload``: between steps the weights and AdamW moments leave the device (their
    storages are empty) and come back unchanged; a method needing them takes them back by itself."""
    samples = make_samples(advantages=[1.0, -0.5, 0.25])
    be, twin = (TorchBackend(make_cfg(), tiny_model_dir) for _ in range(2))
    samples["rollout_log_probs"] = be.compute_log_probs(samples)
    for b in (be, twin):
        b.train_step(samples)
    freed = be.offload()
    moments = [v for s in be.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert moments and all(t.untyped_storage().nbytes() == 0 for t in [*be.model.parameters(), *moments])
    n_params = sum(p.numel() for p in be.model.parameters())
    assert freed >= 3 * 4 * n_params  # weights + two moments, float32
    assert be.onload() == freed and be.onload() == 0
    m, m_twin = be.train_step(samples), twin.train_step(samples)
    assert m["loss"] == m_twin["loss"]
    for (n, a), (_, b) in zip(weights(be).items(), weights(twin).items()):
        assert torch.equal(a, b), n
    be.offload()
    assert be.compute_log_probs(samples)[0].tolist() == twin.compute_log_probs(samples)[0].tolist()


def test_torch_compile_gives_eager_s_loss_and_gradients(tiny_model_dir):
    """--torch-compile (#51): a training step through the compiled forward has eager's loss, ratio and
    gradient within fp32 rounding (the weights after it too, but for entries whose gradient is rounding
    itself: Adam's first step moves each weight by lr times the sign of its gradient). Where compiling is
    impossible the run falls back to eager, said once (test_compiled.py)."""
    from relax_core.compiled import cannot_compile

    if cannot_compile():
        pytest.skip(cannot_compile())
    samples = make_samples(advantages=[1.0, -0.5, 0.25])
    samples["rollout_log_probs"] = TorchBackend(make_cfg(), tiny_model_dir).compute_log_probs(samples)
    runs = {}
    for compiled in (False, True):
        cfg = make_cfg(micro_batch_size=8)
        cfg.model.torch_compile = compiled
        be = TorchBackend(cfg, tiny_model_dir)
        metrics = be.train_step(samples)
        grads = {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}
        runs[compiled] = (metrics, grads, weights(be), be._forward.fell_back)
    (m_e, g_e, w_e, _), (m_c, g_c, w_c, fell_back) = runs[False], runs[True]
    assert fell_back is None  # (it compiled: not eager under another name)
    for key in ("loss", "pg_loss", "ratio_mean", "grad_norm"):
        assert m_c[key] == pytest.approx(m_e[key], rel=1e-5, abs=1e-7), key
    assert g_c.keys() == g_e.keys()
    for name, g in g_e.items():
        torch.testing.assert_close(g_c[name], g, rtol=1e-4, atol=1e-7, msg=name)
        settled = g.abs() > 1e-5
        torch.testing.assert_close(w_c[name][settled], w_e[name][settled], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("chunk", [1, 4])
def test_scoring_from_hidden_states_in_chunks_equals_the_logits_path(tiny_model_dir, chunk):
    """--log-probs-chunk-size (#51): the response tokens scored from the decoder's hidden states a few at a
    time give the full-logits path's log-probs, loss and gradients within fp32 rounding."""
    samples = make_samples(advantages=[1.0, -0.5, 0.25])
    samples["rollout_log_probs"] = TorchBackend(make_cfg(), tiny_model_dir).compute_log_probs(samples)
    runs = {}
    for size in (0, chunk):
        cfg = make_cfg(temperature=0.7, entropy_coef=0.01)
        cfg.train.log_probs_chunk_size = size
        be = TorchBackend(cfg, tiny_model_dir)
        assert (be._trunk is None) == (size == 0)
        logp = be.compute_log_probs(samples)
        metrics = be.train_step(samples)
        grads = {n: p.grad.clone() for n, p in be.model.named_parameters() if p.grad is not None}
        runs[size] = (logp, metrics, grads)
    (lp0, m0, g0), (lp1, m1, g1) = runs[0], runs[chunk]
    for a, b in zip(lp0, lp1):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-6)
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert m1[key] == pytest.approx(m0[key], rel=1e-5, abs=1e-7), key
    for name, g in g0.items():
        torch.testing.assert_close(g1[name], g, rtol=1e-4, atol=1e-7, msg=name)
