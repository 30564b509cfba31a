"""ActorWorker's overlapped weight sync: the broadcast of step k's weights runs from a background thread
while step k+1 computes, and step k+1's optimizer waits for it (the fence) before writing the weights the
broadcast reads; receivers get exactly the weights of every version, over a real DCS group."""

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.dcs import WeightReceiver, checksum, free_port  # noqa: E402
from relax_core.testing import in_background, wait_until  # noqa: E402
from relax_train.workers import ActorWorker  # noqa: E402

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

    worker.publish, worker.overlap = slow_publish, True
    before = checksum(worker.backend.named_weights())
    worker.publish_weights()  # returns at once: the broadcast runs in the background
    assert sending.wait(10) and not sent
    step = in_background(worker.backend.train_step, _samples())
    wait_until(lambda: worker._inflight is None, what="the optimizer reaching the fence")
    assert step.thread.is_alive()  # forward and backward done; the optimizer waits for the broadcast
    assert checksum(worker.backend.named_weights()) == before  # nothing written while it reads
    release.set()
    step()
    assert sent == [(0, before)]  # what was sent is version 0's weights, unchanged by step 1
    assert checksum(worker.backend.named_weights()) != before and worker.backend.version == 1
    assert worker._fence_wait_s > 0
    worker.close()


def test_a_failed_background_broadcast_fails_the_next_step_without_the_health_manager(
    tiny_model_dir, tmp_path
):
    worker = ActorWorker(_cfg(tmp_path, health=False), bus=None, model_path=tiny_model_dir)

    def broken(named, version):
        raise RuntimeError("receiver gone")

    worker.publish, worker.overlap = broken, True
    worker.publish_weights()
    with pytest.raises(RuntimeError, match="receiver gone"):
        worker.backend.train_step(_samples())
    worker.close()

    tolerant = ActorWorker(_cfg(tmp_path / "h", health=True), bus=None, model_path=tiny_model_dir)
    tolerant.publish, tolerant.overlap = broken, True
    tolerant.publish_weights()
    tolerant.backend.train_step(_samples())  # under the health manager: counted, the group re-formed
    assert tolerant.dcs_failures == 1 and tolerant.backend.version == 1
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
    assert worker.overlap is overlap
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
    assert got == worker.weight_log  # bitwise the weights of each version, none torn by a later step
