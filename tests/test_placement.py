"""Fully async on GPUs: every role's GPUs apart, all through Ray's accounting (relax_core.placement).

A real Ray cluster on this machine with 4 logical GPUs (Ray hands out GPU ids for declared GPUs whether
or not CUDA is there; nothing here touches a device): the rollout reserves its SGLang engines' GPUs the
way the rollout role does, the megatron trainer reserves its ranks' GPUs the way its rank group does, and no id is given twice. What this cannot show (no GPU here): that SGLang's processes
and megatron's ranks then open those devices."""

from __future__ import annotations

import pytest

from relax_app.cli_config import build_config
from relax_core.placement import check_gpu_demand, gpu_demand

ray = pytest.importorskip("ray")

GPU_RUN = [
    "--prompt-data",
    "unused",
    "--hf-checkpoint",
    "unused",
    "--fully-async",
    "--max-staleness",
    "1",
    "--rollout-backend",
    "sglang",
    "--rollout-num-gpus",
    "2",
    "--train-backend",
    "megatron",
    "--actor-num-gpus-per-node",
    "2",
]


def test_each_role_demands_its_gpus_and_too_many_is_refused_naming_each():
    # ActorFwd holds GPUs only where it runs: several optimizer steps per batch (one: π_prox comes from the
    # training forward)
    assert gpu_demand(build_config(None, GPU_RUN)) == {"rollout": 2, "actor": 2}
    cfg = build_config(None, [*GPU_RUN, "--use-actor-fwd", "--global-batch-size", "64"])
    assert gpu_demand(cfg) == {"rollout": 2, "actor": 2, "actor_fwd": 2}
    check_gpu_demand(gpu_demand(cfg), 6)
    with pytest.raises(
        ValueError, match=r"rollout 2, actor 2, actor_fwd 2 = 6 GPUs, and the Ray cluster has 5"
    ):
        check_gpu_demand(gpu_demand(cfg), 5)
    colocate = build_config(None, [a for a in GPU_RUN if a not in ("--fully-async", "--max-staleness", "1")])
    assert gpu_demand(colocate) == {}  # the roles time-share one set of GPUs


@pytest.fixture
def four_gpus():
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, num_gpus=4, include_dashboard=False)
    yield
    ray.shutdown()


def test_rollout_engines_and_megatron_ranks_get_disjoint_gpus(four_gpus):
    from relax_rollout.engine_factory import sglang_kwargs
    from relax_rollout.worker import _reserve_engine_gpus
    from relax_train.backends.megatron.group import rank_placement

    cfg = build_config(None, [*GPU_RUN, "--no-use-actor-fwd"])
    assert gpu_demand(cfg) == {"rollout": 2, "actor": 2}
    held = []
    try:
        pg, gpu0, options = rank_placement(2, tp=1, cuda=True)  # the trainer's two ranks
        held.append(pg)
        assert len(options) == 1
        extra = sglang_kwargs(cfg)
        rollout_pg = _reserve_engine_gpus(cfg, extra)  # the rollout role, started after them
        held.append(rollout_pg)
        assert len(extra["gpu_ids"]) == 2
        from relax_core.placement import probe_bundles

        taken = [gpu for _, gpu in probe_bundles(held[0], 2)] + extra["gpu_ids"]
        assert gpu0 in taken[:2]
        assert sorted(taken, key=int) == ["0", "1", "2", "3"]  # four GPUs, none given twice
        # the engines' GPUs are Ray's now: another role asking for GPUs gets none of them
        with pytest.raises(RuntimeError, match="the reference role needs 1 GPUs on its node"):
            from relax_core.placement import reserve_gpus

            reserve_gpus(1, "reference", timeout_s=2)
        # colocate, or ids set by hand: nothing reserved
        assert _reserve_engine_gpus(cfg, {"gpu_ids": ["0"]}) is None
    finally:
        for pg in held:
            if pg is not None:
                ray.util.remove_placement_group(pg)
