"""Both training backends hold to :class:`~relax_train.backends.TrainBackend`, the one contract the train
roles are written against: every method with the protocol's parameters (checked on the classes, so a
backend that renames or drops one fails here, megatron's included without starting its ranks), and the
torch backend's behaviour through the protocol alone. Megatron's behaviour against the torch backend's is
``megatron/test_backend.py`` (its worker asserts the protocol on a live MegatronBackend too)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from relax_train.backends import BACKENDS, TrainBackend

METHODS = [
    name for name, v in vars(TrainBackend).items() if inspect.isfunction(v) and not name.startswith("_")
]


def _classes():
    from relax_train.backends.torch_backend import TorchBackend

    out = [TorchBackend]
    try:
        from relax_train.backends.megatron.backend import MegatronBackend
    except ImportError:  # megatron-core is an extra
        return out
    return [*out, MegatronBackend]


def test_the_protocol_names_what_the_roles_call():
    assert set(METHODS) == {
        "compute_log_probs",
        "train_step",
        "eval_model",
        "named_weights",
        "load_weights",
        "save_checkpoint",
        "load_checkpoint",
        "offload",
        "onload",
        "streamed_step",
    }
    assert set(BACKENDS) == {"torch", "megatron"}


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_every_backend_class_has_the_protocols_methods(cls):
    for name in METHODS:
        want = list(inspect.signature(getattr(TrainBackend, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} != TrainBackend.{name}{want}"
    for name in ("stochastic_forward", "supports_streamed_step", "before_update"):
        assert hasattr(cls, name), f"{cls.__name__} does not declare TrainBackend.{name}"


def test_the_protocol_takes_the_typed_batch():
    """A backend reads the samples as a :class:`relax_core.sample.TrainBatch` (typed columns), and so does every
    backend class, so the type checker sees each field a backend reads."""
    for cls in [TrainBackend, *_classes()]:
        for name in ("compute_log_probs", "train_step"):
            ann = inspect.signature(getattr(cls, name)).parameters["samples"].annotation
            assert ann == "TrainBatch", f"{cls.__name__}.{name}(samples: {ann})"


def test_backends_share_components_not_a_base_class():
    """The megatron backend holds the torch backend's loss and step code as components; it is not a
    TorchBackend (an ``isinstance`` check once sent it down the torch backend's streamed path)."""
    from relax_train.backends.torch_backend import TorchBackend

    assert TorchBackend.supports_streamed_step
    for cls in _classes()[1:]:
        assert not issubclass(cls, TorchBackend) and not cls.supports_streamed_step


def test_the_torch_backend_through_the_protocol(tiny_model_dir, tmp_path):
    from relax_core.config import RelaxConfig
    from relax_train.backends import build_backend

    seqs = [([3, 12, 4, 13], [5, 6, 1]), ([7, 12, 8], [10]), ([4, 13], [3, 3, 1])]
    samples = {
        "tokens": [np.asarray(p + r, dtype=np.int64) for p, r in seqs],
        "prompt_len": [len(p) for p, _ in seqs],
        "loss_mask": [np.ones(len(r), dtype=np.float32) for _, r in seqs],
        "advantages": [np.full(len(r), a, dtype=np.float32) for (_, r), a in zip(seqs, (1.0, -1.0, 0.5))],
    }
    cfg = RelaxConfig.model_validate({"rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 3}})
    backend = build_backend("torch", config=cfg, model_path=tiny_model_dir)
    assert isinstance(backend, TrainBackend) and backend.version == 0
    logp = backend.compute_log_probs(samples)
    assert [len(x) for x in logp] == [len(r) for _, r in seqs] and all(np.isfinite(x).all() for x in logp)
    metrics = backend.train_step({**samples, "rollout_log_probs": logp})
    assert backend.version == 1 and all(np.isfinite(v) for v in metrics.values())
    names = [n for n, _ in backend.named_weights()]
    assert "lm_head.weight" in names or "model.embed_tokens.weight" in names
    backend.save_checkpoint(tmp_path / "ck")
    backend.load_weights({names[0]: dict(backend.named_weights())[names[0]] * 0}, version=7)
    assert backend.version == 7
    meta = backend.load_checkpoint(tmp_path / "ck")
    assert meta == {"version": 1} and backend.version == 1  # its own state only: the run's lies beside it
    assert backend.offload() >= 0 and backend.onload() >= 0
    assert backend.eval_model() is not None
