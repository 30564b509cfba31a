import json
import multiprocessing as mp
import sys
import threading
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from relax_core.dcs import SyncStats, WeightReceiver, WeightSender, checksum  # noqa: E402
from relax_core.net import free_port  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from dcs_workers import (  # noqa: E402
    BUCKET_BYTES,
    VERSIONS,
    _ready_receiver_main,
    _receiver_main,
    connect_all,
    make_params,
    run_exchange,
)


@pytest.fixture(scope="module", params=["broadcast", "ipc"])
def exchange(request):
    """One sender (this process) and two spawned receivers: over a gloo broadcast, or (``ipc``) mapping the
    sender's shared-memory buffers."""
    return run_exchange(request.param)


def test_receivers_get_bitwise_equal_weights_in_order(exchange):
    assert exchange["got"][1]["results"] == exchange["sent"]
    assert [v for v, _ in exchange["got"][1]["results"]] == VERSIONS
    assert exchange["got"][1]["latest"] == VERSIONS[-1]


def test_background_mode_calls_on_weights_per_version(exchange):
    assert exchange["got"][2]["results"] == exchange["sent"]
    assert exchange["got"][2]["latest"] == VERSIONS[-1]


def test_buckets_and_stats(exchange):
    for st, v in zip(exchange["stats"], VERSIONS):
        assert isinstance(st, SyncStats) and st.version == v
        assert st.num_buckets >= 4  # float32 split + bfloat16 + int64
        expected = sum(t.numel() * t.element_size() for _, t in make_params(v))
        assert st.num_bytes == expected


def test_clean_shutdown(exchange):
    assert exchange["exitcodes"] == [0, 0]
    assert all(r["clean"] for r in exchange["got"].values())
    for name in exchange["segments"]:  # ipc: the sender unlinked its shared-memory segments on close
        with pytest.raises(FileNotFoundError):
            SharedMemory(name=name)


def test_checksum_order_independent_and_sensitive():
    params = make_params(1)
    assert checksum(params) == checksum(list(reversed(params)))
    assert checksum(params) == checksum(dict(params).items())
    changed = [(n, t.clone()) for n, t in params]
    changed[2][1][3, 4] += 1
    assert checksum(changed) != checksum(params)
    # dtype and shape are part of the hash, not only the bytes
    x = torch.zeros(4, dtype=torch.int32)
    assert checksum([("x", x)]) != checksum([("x", x.view(torch.float32))])
    assert checksum([("x", x)]) != checksum([("x", x.reshape(2, 2))])


def test_in_process_threads_and_version_checks():
    """A standalone group per endpoint: sender and receiver can even share one process."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    recv = WeightReceiver(init_method, 2, 1, timeout_s=30)
    sender = WeightSender(init_method, 2, bucket_bytes=BUCKET_BYTES, timeout_s=30)
    t = threading.Thread(target=recv.connect)
    t.start()
    sender.connect()
    t.join()
    seen = []
    recv.start_background(lambda v, ts: seen.append((v, checksum(ts.items()))))
    sender.broadcast(make_params(3), version=3)
    with pytest.raises(ValueError, match="increase"):
        sender.broadcast(make_params(2), version=2)
    sender.close()
    recv.join(timeout=30)
    recv.check()
    assert seen == [(3, checksum(make_params(3)))]
    recv.close()


def test_a_dead_member_fails_fast_and_the_group_is_re_formed():
    """What the health manager relies on: a broadcast to a dead receiver errors at once (no hang until the
    time-out), a surviving receiver's loop ends with an error once the sender drops the group, and the
    sender can form a new group and go on with the current weights."""
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    queue = ctx.Queue()  # held: the children unpickle it after start()
    kids = [
        ctx.Process(target=_receiver_main, args=(init_method, 3, r, True, queue), daemon=True) for r in (1, 2)
    ]
    for k in kids:
        k.start()
    sender = WeightSender(init_method, 3, bucket_bytes=BUCKET_BYTES, timeout_s=60)
    sender.connect()
    sender.broadcast(make_params(1), version=1)
    kids[1].kill()
    kids[1].join(timeout=30)
    with pytest.raises(RuntimeError):
        sender.broadcast(make_params(2), version=2)
    sender.abandon()
    kids[0].join(timeout=60)
    assert kids[0].exitcode not in (0, None)  # the survivor saw the group fail (its check() raised)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    newcomer = WeightReceiver(init_method, 2, 1, timeout_s=60)
    sender = WeightSender(init_method, 2, bucket_bytes=BUCKET_BYTES, timeout_s=60)
    connect_all(sender, [newcomer])
    got = []
    newcomer.start_background(lambda v, ts: got.append((v, checksum(ts.items()))))
    sender.broadcast(make_params(2), version=2)  # the version the failed broadcast carried
    sender.close()
    newcomer.join(timeout=30)
    newcomer.check()
    assert got == [(2, checksum(make_params(2)))]
    newcomer.close()


def test_bad_arguments_say_what_to_fix():
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        WeightSender("env://", 2)
    with pytest.raises(ValueError, match="world_size"):
        WeightSender("tcp://127.0.0.1:1234", 1)
    with pytest.raises(ValueError, match="rank 0"):
        WeightReceiver("tcp://127.0.0.1:1234", 2, 0)
    with pytest.raises(RuntimeError, match="connect"):
        WeightSender("tcp://127.0.0.1:1234", 2).broadcast([], version=0)


@pytest.mark.integration
def test_sync_between_ray_actors(monkeypatch):
    # workers share this venv: skip Ray's `uv run` hook, which would rebuild the workspace per job
    monkeypatch.setenv("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray = pytest.importorskip("ray")
    # the actors below use this module's helpers, which Ray workers cannot import by name
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(sys.modules["dcs_workers"])

    @ray.remote(num_cpus=1)
    class Trainer:
        def __init__(self, init_method):
            self.sender = WeightSender(init_method, 2, bucket_bytes=BUCKET_BYTES, timeout_s=60)

        def connect(self):
            self.sender.connect()

        def step(self, version):
            params = make_params(version)
            self.sender.broadcast(params, version)
            return checksum(params)

        def close(self):
            self.sender.close()

    @ray.remote(num_cpus=1)
    class Engine:
        def __init__(self, init_method):
            self.recv = WeightReceiver(init_method, 2, 1, timeout_s=60)
            self.seen = []

        def connect(self):
            self.recv.connect()
            self.recv.start_background(lambda v, ts: self.seen.append((v, checksum(ts.items()))))

        def wait_done(self):
            self.recv.join(timeout=60)
            self.recv.check()
            return self.seen

    started = not ray.is_initialized()  # another test module may already hold a cluster
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False)
    try:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        trainer, engine = Trainer.remote(init_method), Engine.remote(init_method)
        ray.get([trainer.connect.remote(), engine.connect.remote()])
        sent = [(v, ray.get(trainer.step.remote(v))) for v in VERSIONS]
        ray.get(trainer.close.remote())
        assert ray.get(engine.wait_done.remote()) == sent
    finally:
        if started:
            ray.shutdown()


# -- transport="ipc": the receivers map the sender's buffers (POSIX shared memory on CPU) ---------------


def test_ipc_broadcast_returns_only_after_every_receiver_read_the_buffers():
    """The sender may rewrite its buffers for the next version only once each receiver copied this one
    out: a receiver that is slow to copy holds the sender back, and never sees the next version's bytes."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    recv = WeightReceiver(init_method, 2, 1, timeout_s=30, transport="ipc")
    sender = WeightSender(init_method, 2, bucket_bytes=BUCKET_BYTES, timeout_s=30, transport="ipc")
    connect_all(sender, [recv])
    release, seen = threading.Event(), []

    def slow(version, tensors):
        if version == 1:
            assert release.wait(30)
        seen.append((version, checksum(tensors.items())))

    recv.start_background(slow)
    first = threading.Thread(target=sender.broadcast, args=(make_params(1), 1))
    first.start()
    first.join(0.5)
    assert first.is_alive()  # still waiting for the receiver to read version 1
    release.set()
    first.join(30)
    sender.broadcast(make_params(2), version=2)
    sender.close()
    recv.join(30)
    recv.check()
    recv.close()
    assert seen == [(1, checksum(make_params(1))), (2, checksum(make_params(2)))]


def test_ipc_abandon_releases_a_sender_waiting_for_a_dead_receiver():
    init_method = f"tcp://127.0.0.1:{free_port()}"
    silent = WeightReceiver(init_method, 2, 1, timeout_s=60, transport="ipc")  # joins, never reads
    sender = WeightSender(init_method, 2, bucket_bytes=BUCKET_BYTES, timeout_s=60, transport="ipc")
    connect_all(sender, [silent])
    failed = []

    def send():
        try:
            sender.broadcast(make_params(1), version=1)
        except RuntimeError as e:
            failed.append(str(e))

    t = threading.Thread(target=send)
    t.start()
    t.join(0.5)
    assert t.is_alive()
    segments = [json.loads(h)["shm"] for h in sender._shared.handles]
    sender.abandon()  # what the health manager's re-forming of the group does
    t.join(10)
    assert not t.is_alive() and "re-formed" in failed[0]
    for name in segments:
        with pytest.raises(FileNotFoundError):
            SharedMemory(name=name)
    silent.close(timeout_s=1)


def test_transport_is_checked():
    with pytest.raises(ValueError, match="transport must be one of"):
        WeightSender("tcp://127.0.0.1:1", 2, transport="rdma")


def test_the_device_is_fixed_when_the_endpoint_is_made(monkeypatch):
    """NCCL buffers go to the GPU the constructing thread had, by index: a background thread (the overlapped
    sender, the receiver thread) has CUDA's default device 0 as its current one. (No GPU here: the current
    device is stubbed; the allocation on it is not exercised.)"""
    import threading

    import torch

    from relax_core.dcs import WeightReceiver, WeightSender
    from relax_core.dcs_transport import resolve_device

    assert resolve_device("gloo") == "cpu"
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("nccl") == "cuda:3"
    sender = WeightSender("tcp://127.0.0.1:1", 2, backend="nccl")
    receiver = WeightReceiver("tcp://127.0.0.1:1", 2, 1, backend="nccl", device="cuda:1")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # what another thread sees
    seen = []
    t = threading.Thread(target=lambda: seen.extend([sender._ep.device, receiver._ep.device]))
    t.start()
    t.join()
    assert seen == ["cuda:3", "cuda:1"]
    with pytest.raises(ValueError, match="cuda:N"):
        WeightSender("tcp://127.0.0.1:1", 2, backend="nccl", device="cuda")


def test_a_receiver_that_stops_answering_mid_sync_fails_the_broadcast_at_the_time_out():
    """A receiver cut off the network mid-sync looks like this one, stopped (SIGSTOP): its sockets stay open
    and nothing comes back. The bucket broadcast gives up at the group's time-out
    (``--weight-sync-timeout-s``) with a SyncTimeout that says so, a RuntimeError as a dead member's (the
    trainer trains on, the health manager re-forms the group); it held the trainer for 300 s before."""
    import os
    import signal
    import time

    from relax_core.config_sections import RunConfig
    from relax_core.dcs import SyncTimeout

    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{free_port()}"
    queue = ctx.Queue()
    kid = ctx.Process(target=_ready_receiver_main, args=(init_method, 2, 1, queue), daemon=True)
    kid.start()
    sender = WeightSender.for_run(RunConfig(weight_sync_timeout_s=3), init_method, 2)
    try:
        assert queue.get(timeout=120) == "ready"
        sender.connect()
        sender.broadcast(make_params(1), version=1)
        os.kill(kid.pid, signal.SIGSTOP)
        big = [("w", torch.zeros(64 << 20, dtype=torch.uint8))]  # (past what the socket buffers hold)
        t0 = time.monotonic()
        with pytest.raises(SyncTimeout, match="--weight-sync-timeout-s") as err:
            sender.broadcast(big, version=2)
        waited = time.monotonic() - t0
        assert isinstance(err.value, RuntimeError) and "version 2" in str(err.value)
        assert waited < 60, waited  # the group's 3 s, not a hang
    finally:
        os.kill(kid.pid, signal.SIGKILL)
        kid.join(timeout=30)
        sender.abandon()
