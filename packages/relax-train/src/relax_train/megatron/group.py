"""A megatron trainer of several ranks inside a run.

A role (trainer, ActorFwd, reference) is one Ray actor; with model parallelism its backend needs one
process per rank. This process becomes rank 0 and starts ranks 1..N-1 as Ray actors it owns (they die
with it, so a restarted role starts a fresh group); every backend call runs on all ranks at once, and
the role sees rank 0's answer. Each rank is a GPU (``--actor-num-nodes`` × ``--actor-num-gpus-per-node``);
on a machine without CUDA the ranks are CPU processes (gloo), which is how CI runs a tensor-parallel
trainer inside a fully-async run.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from relax_core.config import RelaxConfig


def world_size(config: RelaxConfig) -> int:
    t = config.train
    return max(1, t.actor_num_nodes * t.actor_num_gpus_per_node)


def build_megatron(config: RelaxConfig, model_path: str, trainable: bool = True):
    """The registry's factory: one process's :class:`MegatronBackend`, or a :class:`MegatronRankGroup`
    when the run gives the trainer several ranks and this process is not already one of them."""
    from relax_train.megatron.backend import MegatronBackend

    world = world_size(config)
    if world == 1 or "WORLD_SIZE" in os.environ:  # one rank, or a launcher (torchrun, tests) started them
        return MegatronBackend(config, model_path, trainable)
    return MegatronRankGroup(config, model_path, trainable, world)


class _Rank:
    """Ranks 1..N-1: a backend in its own process, driven by rank 0."""

    def __init__(self, config, model_path, trainable, rank, world, addr, port, threads) -> None:
        import torch

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port))
        os.environ.setdefault("LOCAL_RANK", "0")  # Ray shows each rank only its own GPU
        torch.set_num_threads(threads)
        from relax_train.megatron.backend import MegatronBackend

        self.backend = MegatronBackend(config, model_path, trainable)

    def call(self, method: str, *args, **kwargs):
        out = getattr(self.backend, method)(*args, **kwargs)
        return None if method in ("named_weights", "eval_model") else out  # rank 0's copy is the one used

    def ready(self) -> bool:
        return True

    def set(self, name: str, value: Any) -> None:
        setattr(self.backend, name, value)


_COLLECTIVE = (
    "compute_log_probs",
    "train_step",
    "named_weights",
    "load_weights",
    "save_checkpoint",
    "load_checkpoint",
    "eval_model",
    "export_hf",
)


class MegatronRankGroup:
    """Same protocol as the backends; the collective methods run on every rank in lockstep."""

    def __init__(self, config: RelaxConfig, model_path: str, trainable: bool, world: int) -> None:
        import ray
        import torch

        if not ray.is_initialized():
            raise ValueError(
                f"--train-backend megatron with {world} ranks runs its ranks as Ray actors: use --fully-async "
                "(colocate mode runs every role in one process)"
            )
        addr = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        cuda = torch.cuda.is_available()
        threads = torch.get_num_threads()
        rank_actor = ray.remote(num_gpus=1 if cuda else 0, num_cpus=0)(_Rank)
        self._others = [
            rank_actor.remote(config, model_path, trainable, r, world, addr, port, threads)
            for r in range(1, world)
        ]
        os.environ.update(RANK="0", WORLD_SIZE=str(world), MASTER_ADDR=addr, MASTER_PORT=str(port))
        os.environ.setdefault("LOCAL_RANK", "0")
        from relax_train.megatron.backend import MegatronBackend

        self._local = MegatronBackend(config, model_path, trainable)  # joins the others' process group
        ray.get([r.ready.remote() for r in self._others])

    def _all(self, method: str, *args, **kwargs):
        import ray

        refs = [r.call.remote(method, *args, **kwargs) for r in self._others]
        out = getattr(self._local, method)(*args, **kwargs)
        ray.get(refs)
        return out

    def __getattr__(self, name: str):
        if name in _COLLECTIVE:
            return lambda *args, **kwargs: self._all(name, *args, **kwargs)
        return getattr(self._local, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        import ray

        setattr(self._local, name, value)  # e.g. the teacher role turns routing replay off
        if name == "before_update":  # the trainer's fence: only rank 0's weights are sent from a thread
            return  # (the other ranks' shards were gathered before the broadcast started)
        ray.get([r.set.remote(name, value) for r in self._others])
