"""The megatron critic (:mod:`relax_train.backends.megatron.value`) on gloo, one rank on CPU: its values
against the torch value backend's on the same trunk and head, its fit, and its checkpoints (loaded back
exactly, and by the torch value backend).

megatron-core's parallel state is global to a process, so the backend runs in one child process (this file
run as a script, ``python test_value.py SPEC OUT``: importing megatron-core costs ~15 s a process), once for
the whole module; the tests read its results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relax_app.cli_config import build_config  # noqa: E402
from relax_core import sample  # noqa: E402
from relax_testing import tiny_qwen3_config  # noqa: E402

FLAGS = ["--advantage-estimator", "gae", "--micro-batch-size", "2", "--critic-lr", "1e-3"]
TRAIN_CALLS = 3  # train_values calls before the checkpoint


def _config(model: str):
    return build_config(None, ["--prompt-data", "unused", "--hf-checkpoint", model, *FLAGS])


def _samples() -> dict:
    """Four samples of different prompt and response lengths (two micro-batches)."""
    rng = np.random.default_rng(0)
    lens, plens = (9, 11, 6, 10), (4, 5, 2, 6)
    return {
        sample.TOKENS: [rng.integers(0, 300, n) for n in lens],
        sample.PROMPT_LEN: list(plens),
    }


def _fit_fields(samples: dict, values: list[np.ndarray]) -> dict:
    """``samples`` with the critic's fields: old values, returns in [-1, 1], and a loss mask with one token
    out (an observation: its return must not count)."""
    rng = np.random.default_rng(1)
    masks = [np.ones(len(v), np.float32) for v in values]
    masks[1][2] = 0.0
    returns = [rng.uniform(-1.0, 1.0, len(v)).astype(np.float32) for v in values]
    returns[1][2] = 100.0  # masked: would dominate the loss if it counted
    return {**samples, sample.VALUES: values, sample.RETURNS: returns, sample.LOSS_MASK: masks}


# -- the child process --------------------------------------------------------------------------------


def _optimizer_state(backend) -> list[dict]:
    return [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in backend.optimizer.state[p].items()}
        for p in backend.model.parameters()
    ]


def _weights(backend) -> dict:
    return {k: v.clone() for k, v in backend.model.state_dict().items() if not k.endswith("_extra_state")}


def _worker(spec_path: str, out_path: str) -> None:
    from relax_train.backends.megatron.value import MegatronValueBackend

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    cfg, samples = _config(spec["model"]), _samples()
    out: dict = {"zero_head": MegatronValueBackend(cfg, spec["model"]).compute_values(samples)}
    a = MegatronValueBackend(cfg, spec["torch_critic"])  # the torch critic's trunk and head
    out["values"] = a.compute_values(samples)
    fit = _fit_fields(samples, out["values"])
    out["metrics"] = [a.train_values(fit) for _ in range(TRAIN_CALLS)]
    out["values_trained"] = a.compute_values(samples)
    a.save_checkpoint(spec["ckpt"])
    b = MegatronValueBackend(cfg, spec["model"])
    try:
        b.load_checkpoint(spec["torch_ckpt"])
    except ValueError as e:
        out["torch_ckpt_refused"] = str(e)
    out["meta"] = b.load_checkpoint(spec["ckpt"])
    out["versions"] = (a.version, b.version)
    out["weights"] = (_weights(a), _weights(b))
    out["optimizer"] = (_optimizer_state(a), _optimizer_state(b))
    out["freed"] = b.offload(), b.onload()
    out["then"] = (a.train_values(fit), b.train_values(fit))  # the restored AdamW at work
    out["values_then"] = (a.compute_values(samples), b.compute_values(samples))
    torch.save(out, out_path)


# -- the tests ----------------------------------------------------------------------------------------


def _sharpen(model) -> None:
    """Random weights large enough that hidden states differ well across positions (norm weights near 1)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.2 * noise)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """A tiny random Qwen3, a torch critic of it with a random head (its checkpoint, and its values), and the
    child's results on them."""
    pytest.importorskip("megatron.core")
    from relax_train.backends.value import TorchValueBackend

    tmp = tmp_path_factory.mktemp("megatron_value")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(**tiny_qwen3_config(max_position_embeddings=128))
    model = transformers.Qwen3ForCausalLM(config)
    _sharpen(model)
    model.save_pretrained(tmp / "model")
    critic = TorchValueBackend(_config(str(tmp / "model")), str(tmp / "model"))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        critic.model.score.weight.copy_(0.1 * torch.randn(critic.model.score.weight.shape, generator=gen))
        critic.model.score.bias.fill_(0.3)
    critic.save_checkpoint(tmp / "torch_ckpt")
    paths = {
        "model": tmp / "model",
        "torch_ckpt": tmp / "torch_ckpt",
        "torch_critic": tmp / "torch_ckpt" / "critic",
        "ckpt": tmp / "ckpt",
    }
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    out = tmp / "out.pt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, __file__, str(spec), str(out)],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out, weights_only=False)
    result["torch_values"] = critic.compute_values(_samples())
    result["paths"] = paths
    return result


def test_values_have_the_response_lengths_and_a_new_head_values_zero(run):
    samples = _samples()
    rlens = [len(t) - p for t, p in zip(samples[sample.TOKENS], samples[sample.PROMPT_LEN])]
    for key in ("zero_head", "values"):
        assert [len(v) for v in run[key]] == rlens
        assert all(v.dtype == np.float32 for v in run[key])
    assert all(not v.any() for v in run["zero_head"])


def test_values_equal_the_torch_value_backend_on_the_same_trunk_and_head(run):
    """The torch critic's checkpoint (trunk and ``score`` head) loaded by megatron: the same values."""
    assert np.concatenate(run["values"]).std() > 0.05  # (values that differ by position: a real check)
    for got, want in zip(run["values"], run["torch_values"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_training_on_a_fixed_batch_reduces_the_value_loss(run):
    losses = [m["value_loss"] for m in run["metrics"]]
    assert losses[-1] < losses[0]
    assert losses[0] < 5.0  # the masked return of 100 does not count
    m = run["metrics"][0]
    assert m["optimizer_steps"] == 1.0  # one pass of one step (--critic-global-batch-size: the batch)
    assert m["lr"] == pytest.approx(1e-3)
    assert m["grad_norm"] > 0.0
    kept = np.concatenate([np.delete(v, 2) if i == 1 else v for i, v in enumerate(run["values"])])
    assert m["vpred_mean"] == pytest.approx(float(kept.mean()), abs=1e-5)  # (the first step: old weights)
    assert 0.0 <= m["value_clipfrac"] <= 1.0
    assert run["versions"][0] == TRAIN_CALLS


def test_a_checkpoint_restores_weights_optimizer_state_and_version_exactly(run):
    assert run["meta"]["version"] == TRAIN_CALLS
    assert run["versions"] == (TRAIN_CALLS, TRAIN_CALLS)
    wa, wb = run["weights"]
    assert set(wa) == set(wb) and {"output_layer.weight", "output_layer.bias"} <= set(wa)
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    oa, ob = run["optimizer"]
    assert len(oa) == len(ob) and all(s for s in oa)
    for sa, sb in zip(oa, ob):
        assert set(sa) == set(sb) == {"step", "exp_avg", "exp_avg_sq"}
        for k in sa:
            assert torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])), k
    ma, mb = run["then"]  # one more step each: the restored moments and step count at work
    assert ma == mb
    for va, vb in zip(*run["values_then"]):
        np.testing.assert_array_equal(va, vb)


def test_the_torch_value_backend_loads_a_megatron_critic_with_its_values(run):
    from relax_train.backends.value import TorchValueBackend

    model, ckpt = run["paths"]["model"], run["paths"]["ckpt"]
    critic = TorchValueBackend(_config(str(model)), str(ckpt / "critic"))
    for got, want in zip(critic.compute_values(_samples()), run["values_trained"], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)
    assert "--train-backend torch" in run["torch_ckpt_refused"]  # (its AdamW is of other tensors)


def test_model_parallel_sizes_are_refused_with_the_flags_to_change(tmp_path):
    from relax_train.backends.megatron.value import check_value_parallelism

    cfg = build_config(
        None,
        [
            "--prompt-data",
            "unused",
            "--hf-checkpoint",
            str(tmp_path),
            *FLAGS,
            "--tensor-model-parallel-size",
            "2",
        ],
    )
    with pytest.raises(ValueError, match="--tensor-model-parallel-size 2"):
        check_value_parallelism(cfg)
    check_value_parallelism(_config(str(tmp_path)))  # one rank: accepted


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
