"""ActorWorker's overlapped weight sync: the broadcast of step k's weights runs from a background thread
while step k+1 computes, and step k+1's optimizer waits for it (the fence) before writing the weights the
broadcast reads; receivers get exactly the weights of every version, over a real DCS group."""

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.dcs import WeightReceiver, checksum  # noqa: E402
from relax_core.net import free_port  # noqa: E402
from relax_testing import in_background, wait_until  # noqa: E402
from relax_train.roles.actor import ActorWorker  # noqa: E402

SEQS = [([3, 12, 4, 13], [5, 6, 1]), ([7, 12, 8, 12, 9, 13], [10])]


def _cfg(tmp_path, **run) -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "run": {"output_dir": str(tmp_path), "trace": False, "tensorboard": False, **run},
            "train": {"micro_batch_size": 2, "lr": 1e-2},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": len(SEQS)},
        }
    )


def _samples():
    import numpy as np

    out = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": [], "rollout_log_probs": []}
    for k, (p, r) in enumerate(SEQS):
        out["rollout_log_probs"].append(np.full(len(r), -4.0, dtype=np.float32))
        out["tokens"].append(np.asarray(p + r, dtype=np.int64))
        out["prompt_len"].append(len(p))
        out["loss_mask"].append(np.ones(len(r), dtype=np.float32))
        out["advantages"].append(np.full(len(r), 1.0 if k == 0 else -1.0, dtype=np.float32))
    return out


def test_next_step_waits_for_the_broadcast_before_its_optimizer_writes(tiny_model_dir, tmp_path):
    worker = ActorWorker(_cfg(tmp_path), bus=None, model_path=tiny_model_dir)
    release, sending, sent = threading.Event(), threading.Event(), []

    def slow_publish(named, version):  # a broadcast that takes as long as the test says
        sending.set()
        assert release.wait(30)
        sent.append((version, checksum(named)))

    worker.weights.send, worker.weights.overlap = slow_publish, True
    before = checksum(worker.backend.named_weights())
    worker.publish_weights()  # returns at once: the broadcast runs in the background
    assert sending.wait(10) and not sent
    worker.steps.alive()  # (a trainer that has taken its batch)
    step = in_background(worker.backend.train_step, _samples())
    wait_until(lambda: not worker.weights.in_flight, what="the optimizer reaching the fence")
    assert step.thread.is_alive()  # forward and backward done; the optimizer waits for the broadcast
    time.sleep(1.2)  # waiting at the fence is not a hang: the heartbeat stays fresh (a receiver cut off
    assert worker.heartbeat()["age_s"] < 1.0  # holds a broadcast until the group is re-formed)
    assert checksum(worker.backend.named_weights()) == before  # nothing written while it reads
    release.set()
    step()
    assert sent == [(0, before)]  # what was sent is version 0's weights, unchanged by step 1
    assert checksum(worker.backend.named_weights()) != before and worker.backend.version == 1
    assert worker.weights.fence_wait_s > 0
    worker.close()


def test_a_failed_background_broadcast_fails_the_next_step_without_the_health_manager(
    tiny_model_dir, tmp_path
):
    worker = ActorWorker(_cfg(tmp_path, health=False), bus=None, model_path=tiny_model_dir)

    def broken(named, version):
        raise RuntimeError("receiver gone")

    worker.weights.send, worker.weights.overlap = broken, True
    worker.publish_weights()
    with pytest.raises(RuntimeError, match="receiver gone"):
        worker.backend.train_step(_samples())
    worker.close()

    tolerant = ActorWorker(_cfg(tmp_path / "h", health=True), bus=None, model_path=tiny_model_dir)
    tolerant.weights.send, tolerant.weights.overlap = broken, True
    tolerant.publish_weights()
    tolerant.backend.train_step(_samples())  # under the health manager: counted, the group re-formed
    assert tolerant.weights.failures == 1 and tolerant.backend.version == 1
    tolerant.close()


@pytest.mark.parametrize("overlap", [True, False])
def test_receivers_get_every_version_exactly_over_dcs(tiny_model_dir, tmp_path, overlap):
    cfg = _cfg(tmp_path, verify_weight_sync=True, overlap_weight_sync=overlap)
    worker = ActorWorker(cfg, bus=None, model_path=tiny_model_dir)
    init = f"tcp://127.0.0.1:{free_port()}"
    receiver = WeightReceiver(init, 2, 1, timeout_s=60)
    joined = in_background(receiver.connect)
    worker.connect_dcs(init, 2)
    joined()
    assert worker.weights.overlap is overlap
    got = {}
    receiver.start_background(lambda v, t: got.setdefault(v, checksum(t.items())))
    for _ in range(3):
        worker.publish_weights()
        worker.backend.train_step(_samples())
    worker.publish_weights()
    worker.close()  # waits for the last broadcast, then the shutdown handshake
    receiver.join(30)
    receiver.check()
    assert sorted(got) == [0, 1, 2, 3]
    assert got == worker.record.weight_log  # bitwise the weights of each version, none torn by a later step


def test_actor_fwd_never_computes_on_half_loaded_weights(tmp_path):
    """The DCS receiver thread loads a new version while ActorFwd's loop computes log-probs: the load waits
    for the forward in progress, and the forward's stamp is the version it computed with."""
    from types import SimpleNamespace

    from relax_train.roles.forward import ForwardWorker

    events: list[str] = []
    started = threading.Event()

    class Backend:
        version = 0

        def compute_log_probs(self, data):
            started.set()
            events.append(f"forward v{self.version} start")
            threading.Event().wait(0.3)
            events.append(f"forward v{self.version} end")
            return [0.0] * len(data["tokens"])

        def load_weights(self, tensors, version):
            events.append(f"load v{version}")
            self.version = version

    written: dict = {}
    bus = SimpleNamespace(add_fields=lambda ids, fields: written.update(fields))
    fwd = ForwardWorker(_cfg(tmp_path), bus, "actor_fwd", "unused", backend=Backend())
    t = threading.Thread(
        target=fwd.handle,
        args=(SimpleNamespace(data={"tokens": [[1], [2]], "prompt_len": [1, 1]}, ids=["a", "b"]),),
    )
    t.start()
    started.wait(5)
    fwd._load_weights(1, {})  # the receiver thread's call
    t.join(5)
    assert events == ["forward v0 start", "forward v0 end", "load v1"]
    assert written["log_probs_version"] == [0, 0]


def test_pi_prox_is_the_trainer_s_policy_for_samples_actor_fwd_scored_with_older_weights(
    tiny_model_dir, tmp_path
):
    """Fully async with two optimizer steps per batch (so ActorFwd runs): a sample ActorFwd scored at
    version 1 is trained at version 3. In the batch's first
    optimizer step its π_prox is the training forward's own (detached) log-probs; in a later step it is
    recomputed before the update. Both checked against a recomputation: the update equals the one made
    with π_prox computed exactly beforehand. A sample scored at version 3 keeps ActorFwd's work, and with
    ``--no-exact-proximal-policy`` nothing is touched (the lag is reported)."""
    import numpy as np

    from relax_train.backends.torch_backend import TorchBackend
    from relax_train.roles.prox import exact_prox

    def backend(cfg):
        b = TorchBackend(cfg, tiny_model_dir)
        b.version = 3
        return b

    for stale in (0, 1):  # the stale sample in the first optimizer step / in the second
        cfg = _cfg(tmp_path, mode="fully_async", max_staleness=2)
        cfg.algo.decoupled_ppo = True
        cfg.train.global_batch_size = 1
        assert not cfg.prox_from_training_forward
        exact = _samples()
        exact["log_probs"] = backend(cfg).compute_log_probs(exact)
        exact["log_probs_version"] = [3, 3]
        d = {**exact, "log_probs": list(exact["log_probs"]), "log_probs_version": [3, 3]}
        d["log_probs"][stale] = np.zeros_like(d["log_probs"][stale])  # another policy's values
        d["log_probs_version"][stale] = 1
        b = backend(cfg)
        m = exact_prox(cfg, b, d)
        assert m["train/actor_fwd_lag_max"] == 2.0
        assert d["log_probs_version"] == [3, 3]
        if stale == 0:
            assert (m["train/prox_from_forward_frac"], m["train/prox_recomputed_frac"]) == (0.5, 0.0)
            assert d["prox_from_forward"] == [True, False]
        else:
            assert (m["train/prox_from_forward_frac"], m["train/prox_recomputed_frac"]) == (0.0, 0.5)
            np.testing.assert_allclose(d["log_probs"][1], exact["log_probs"][1], rtol=0, atol=1e-6)
        got, want = b.train_step(d), (ref := backend(cfg)).train_step(exact)
        assert got["prox_gap_max"] < 1e-5  # π_prox is the trainer's policy
        for key in ("loss", "pg_loss", "grad_norm", "rollout_abs_logp_diff"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (stale, key)
        for (name, p), (_, q) in zip(b.model.named_parameters(), ref.model.named_parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)

    cfg.algo.exact_proximal_policy = False
    d = {**exact, "log_probs_version": [3, 1]}
    m = exact_prox(cfg, backend(cfg), d)
    assert m == {"train/prox_lag_max": 2.0, "train/actor_fwd_lag_max": 2.0}
