"""The run's topology from the config alone: which roles run, the bus consumers and their fields, what
each writes, the DCS receivers, the model each loads — the same for both modes and for the bus. The
installed roles (entry points of relax-rollout and relax-train) first, then the registry's rules on roles
defined here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from relax_app.cli_config import build_config
from relax_core.role import Restart, RoleSpec, missing_methods
from relax_core.roles import RolePlan, RoleRegistry

ARGS = ["--prompt-data", "p", "--hf-checkpoint", "m"]


@pytest.fixture
def installed():
    pytest.importorskip("relax_train")
    pytest.importorskip("relax_rollout")


def plan(*flags: str) -> RolePlan:
    return RolePlan.from_config(build_config(None, [*ARGS, *flags]))


def consumers(p: RolePlan) -> dict[str, tuple[list[str], str, bool]]:
    return {
        n: (c.required_fields, c.sampler, c.enforce_staleness) for n, c in p.bus_config().consumers.items()
    }


def test_the_default_run_takes_pi_prox_from_the_training_forward_no_actor_fwd_no_reference(installed):
    """One optimizer step per batch (the default): π_prox is the training forward's own log-probs, so no
    ActorFwd runs, in either mode and at any staleness (π_prox is exact); the trainer needs advantages only."""
    for flags in ((), ("--fully-async", "--max-staleness", "2")):
        p = plan(*flags)
        assert list(p.roles) == ["rollout", "advantages", "actor"]
        assert p.loops == ["advantages"] and p.receivers == ["rollout"]
        assert (p.rollout, p.trainer) == ("rollout", "actor")
        assert consumers(p) == {
            "advantages": (["reward"], "group", False),
            "actor": (["advantages"], "group", True),
        }


def test_several_optimizer_steps_per_batch_run_actor_fwd(installed):
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


def test_a_kl_loss_adds_the_reference_and_the_trainer_waits_for_it(installed):
    p = plan("--kl-coef", "0.05", "--no-use-actor-fwd")
    assert p.loops == ["advantages", "reference"] and p.receivers == ["rollout"]
    assert consumers(p)["reference"] == (["tokens"], "in_order", False)
    assert consumers(p)["actor"] == (["advantages", "ref_log_probs"], "group", True)


def test_kl_in_the_reward_and_a_teacher(installed):
    p = plan(
        "--kl-coef", "0.05", "--kl-in-reward", "--no-use-kl-loss", "--teacher-checkpoint", "t",
        "--global-batch-size", "64",
    )  # fmt: skip
    # Advantages after Reference, whose log-probs the KL in the reward needs
    assert p.loops == ["actor_fwd", "reference", "advantages", "teacher"]
    c = consumers(p)
    assert c["advantages"] == (["reward", "ref_log_probs"], "group", False)  # the KL shapes the reward first
    assert c["actor"] == (["advantages", "log_probs", "teacher_log_probs"], "group", True)
    assert p.outputs["reference"] == ["ref_log_probs"] and p.outputs["teacher"] == ["teacher_log_probs"]
    inputs = SimpleNamespace(model_path="m", ref_model_path=None, prompt_path="d", eval_path=None)
    assert [p.model_path(n, inputs, "t") for n in p.roles] == ["m", "m", "m", None, "t", "m"]
    args, kwargs = p.arguments("reference", "bus", inputs, 2)
    assert args[1:] == ("bus", "reference", "m") and kwargs == {"torch_threads": 2}
    args, kwargs = p.arguments("actor", "bus", inputs, 2)
    assert kwargs["evaluator"] is p.evaluator is not None  # relax-rollout's, through its entry point


def test_ppo_values_samples_before_advantages_are_computed(installed):
    """--advantage-estimator gae (#39): the Critic takes scored groups, Advantages waits for its values; with
    the KL in the reward both wait for Reference. It loads its own model (--critic-checkpoint, else the
    policy's) and restores its own state on a restart."""
    p = plan("--advantage-estimator", "gae", "--critic-checkpoint", "c")
    assert p.loops == ["critic", "advantages"]
    c = consumers(p)
    assert c["critic"] == (["tokens", "reward"], "group", False)
    assert c["advantages"] == (["reward", "values"], "group", False)
    assert p.outputs == {"critic": ["values", "values_version"], "advantages": ["advantages", "returns"]}
    inputs = SimpleNamespace(model_path="m", ref_model_path=None, prompt_path="d", eval_path=None)
    assert p.model_path("critic", inputs) == "c"  # its spec's checkpoint; without one, the policy's trunk:
    assert plan("--advantage-estimator", "gae").model_path("critic", inputs) == "m"
    assert p.roles["critic"].restart == (Restart.LEASES, Restart.STATE)
    kl = plan("--advantage-estimator", "gae", "--kl-coef", "0.05", "--kl-in-reward", "--no-use-kl-loss")
    assert kl.loops == ["reference", "critic", "advantages"]
    assert consumers(kl)["critic"][0] == ["tokens", "reward", "ref_log_probs"]


def test_restart_steps_are_declared_on_the_specs(installed):
    p = plan("--kl-coef", "0.05", "--global-batch-size", "64", "--fully-async")
    assert {n: s.restart for n, s in p.roles.items()} == {
        "rollout": (Restart.JOURNAL, Restart.WEIGHTS),
        "actor_fwd": (Restart.LEASES, Restart.WEIGHTS),
        "advantages": (Restart.LEASES,),
        "reference": (Restart.LEASES,),
        "actor": (Restart.CHECKPOINT, Restart.WEIGHTS),
    }


def test_every_installed_role_answers_the_protocols_of_its_part(installed):
    reg = RoleRegistry.installed()
    assert set(reg.classes) == {
        "rollout",
        "actor",
        "actor_fwd",
        "reference",
        "teacher",
        "critic",
        "advantages",
    }
    flags = ["--kl-coef", "0.05", "--teacher-checkpoint", "t", "--global-batch-size", "64"]
    cfg = build_config(None, [*ARGS, *flags, "--advantage-estimator", "gae"])
    for name, cls in reg.classes.items():
        spec = cls.spec(cfg, name)
        assert spec is not None and missing_methods(cls, spec) == [], name


# -- the registry's rules, on roles defined here ------------------------------------------------------------
class _Base:
    def heartbeat(self):
        return {}

    def get_spans(self):
        return []

    def close(self):
        pass


class _Rollout(_Base):
    run = produce = reset_journal = seed_journal = load_data_state = recover = restart_engine = _Base.close
    set_weights = release_memory = resume_memory = get_record = _Base.close
    engines = connect_dcs = wait_weights = weight_version = _Base.close

    @classmethod
    def spec(cls, cfg, name):
        return RoleSpec(
            name, part="rollout", receives_weights=True, restart=(Restart.JOURNAL, Restart.WEIGHTS)
        )


class _Trainer(_Base):
    run = train = connect_dcs = publish_weights = eval_now = progress = save = load = _Base.close
    request_stop = get_interrupted = get_record = _Base.close

    @classmethod
    def spec(cls, cfg, name):
        return RoleSpec(name, part="trainer", needs=("a",), restart=(Restart.CHECKPOINT,))


def _consumer(needs, writes, feeds=False):
    class Consumer(_Base):
        run = drain = _Base.close

        @classmethod
        def spec(cls, cfg, name):
            return RoleSpec(name, needs=needs, writes=writes, feeds_trainer=feeds, restart=(Restart.LEASES,))

    return Consumer


def test_a_role_is_one_class_and_one_registry_entry_and_takes_its_place_in_data_order():
    reg = RoleRegistry({"r": _Rollout, "t": _Trainer, "b": _consumer(("a",), ("b",), True)})
    reg = reg.with_role("a", _consumer(("tokens",), ("a",)))  # registered after b, and b needs its field
    p = RolePlan.from_config(build_config(None, ARGS), reg)
    assert list(p.roles) == ["r", "a", "b", "t"] and p.loops == ["a", "b"]
    assert p.roles["t"].needs == ("a", "b")  # b feeds the trainer
    assert (p.rollout, p.trainer, p.receivers) == ("r", "t", ["r"])
    assert p.arguments("a", "bus", None, 1) == (((p.cfg, "bus")), {})  # no model: (cfg, bus)


def test_the_registry_refuses_a_role_that_lacks_a_method_or_a_run_without_a_trainer():
    class Bare:
        @classmethod
        def spec(cls, cfg, name):
            return RoleSpec(name, needs=("tokens",))

    cfg = build_config(None, ARGS)
    with pytest.raises(TypeError, match=r"role 'x' \(Bare, a consumer\) lacks close, drain, get_spans"):
        RolePlan.from_config(cfg, RoleRegistry({"r": _Rollout, "t": _Trainer, "x": Bare}))
    with pytest.raises(ValueError, match="exactly one trainer role"):
        RolePlan.from_config(cfg, RoleRegistry({"r": _Rollout}))
    with pytest.raises(ValueError, match="add Restart.WEIGHTS"):
        RoleSpec("w", needs=("tokens",), receives_weights=True)


def test_a_role_that_restores_its_state_must_load_it():
    """A role whose spec says Restart.STATE answers StatefulRole: the plan refuses a class without
    ``load_state`` before anything starts."""
    from relax_core.role import Restart, RoleSpec, StatefulRole, missing_methods, protocols

    spec = RoleSpec("critic", needs=("tokens",), restart=(Restart.STATE,))
    assert StatefulRole in protocols(spec)

    class NoLoad:
        @classmethod
        def spec(cls, cfg, name): ...

        def heartbeat(self): ...
        def get_spans(self): ...
        def close(self): ...
        def run(self): ...
        def drain(self): ...

    assert missing_methods(NoLoad, spec) == ["load_state", "save_state"]
