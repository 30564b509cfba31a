"""The run's topology from the config alone: which roles run, the bus consumers and their fields, what
each writes, the DCS receivers, the model each loads — the same for both modes and for the bus."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax_core.cli_config import build_config
from relax_core.roles import REGISTRY, RolePlan, role_class


def plan(*flags: str) -> RolePlan:
    return RolePlan.from_config(build_config(None, ["--prompt-data", "p", "--hf-checkpoint", "m", *flags]))


def consumers(p: RolePlan) -> dict[str, tuple[list[str], str, bool]]:
    return {
        n: (c.required_fields, c.sampler, c.enforce_staleness) for n, c in p.bus_config().consumers.items()
    }


def test_the_default_run_takes_pi_prox_from_the_training_forward_no_actor_fwd_no_reference():
    """One optimizer step per batch (the default): π_prox is the training forward's own log-probs, so no
    ActorFwd runs, in either mode and at any staleness (π_prox is exact); the trainer needs advantages only."""
    for flags in ((), ("--fully-async", "--max-staleness", "2")):
        p = plan(*flags)
        assert list(p.roles) == ["rollout", "advantages", "actor"]
        assert p.loops == ["advantages"] and p.receivers == ["rollout"]
        assert consumers(p) == {
            "advantages": (["reward"], "group", False),
            "actor": (["advantages"], "group", True),
        }


def test_several_optimizer_steps_per_batch_run_actor_fwd():
    """Later optimizer steps need π_prox at the weights before the first update: ActorFwd computes it. So
    does fully async without the exact proximal policy (ActorFwd's values as they are)."""
    for flags in (("--global-batch-size", "64"), ("--fully-async", "--no-exact-proximal-policy")):
        p = plan(*flags)
        assert list(p.roles) == ["rollout", "actor_fwd", "advantages", "actor"], flags
    assert p.loops == ["actor_fwd", "advantages"]
    assert p.receivers == ["rollout", "actor_fwd"]  # DCS rank 1 is the rollout, rank 2 ActorFwd
    assert consumers(p) == {
        "actor_fwd": (["tokens"], "in_order", False),
        "advantages": (["reward"], "group", False),
        "actor": (["advantages", "log_probs"], "group", True),
    }
    assert p.outputs == {"actor_fwd": ["log_probs"], "advantages": ["advantages"]}


def test_a_kl_loss_adds_the_reference_and_the_trainer_waits_for_it():
    p = plan("--kl-coef", "0.05", "--no-use-actor-fwd")
    assert p.loops == ["reference", "advantages"] and p.receivers == ["rollout"]
    assert consumers(p)["reference"] == (["tokens"], "in_order", False)
    assert consumers(p)["actor"] == (["advantages", "ref_log_probs"], "group", True)


def test_kl_in_the_reward_and_a_teacher():
    p = plan(
        "--kl-coef", "0.05", "--kl-in-reward", "--no-use-kl-loss", "--teacher-checkpoint", "t",
        "--global-batch-size", "64",
    )  # fmt: skip
    assert p.loops == ["actor_fwd", "reference", "teacher", "advantages"]
    c = consumers(p)
    assert c["advantages"] == (["reward", "ref_log_probs"], "group", False)  # the KL shapes the reward first
    assert c["actor"] == (["advantages", "log_probs", "teacher_log_probs"], "group", True)
    assert p.outputs["reference"] == ["ref_log_probs"] and p.outputs["teacher"] == ["teacher_log_probs"]
    inputs = SimpleNamespace(model_path="m", ref_model_path=None, prompt_path="d", eval_path=None)
    assert [p.model_path(n, inputs, "t") for n in p.roles] == ["m", "m", "m", "t", None, "m"]
    args, kwargs = p.arguments("reference", "bus", inputs, 2)
    assert args[1:] == ("bus", "reference", "m") and kwargs == {"torch_threads": 2}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_role_name_is_a_registry_key_that_imports(name):
    pytest.importorskip("relax_train")
    pytest.importorskip("relax_rollout")
    assert isinstance(role_class(name), type)
