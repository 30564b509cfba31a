"""RelaxConfig: defaults are valid, bounds hold, and cross-field rules reject bad combinations."""

import pytest
from pydantic import ValidationError

from relax_core.config import RelaxConfig


def test_defaults_are_valid_demo_config():
    cfg = RelaxConfig()
    assert cfg.is_demo
    assert cfg.run.mode == "colocate"
    assert cfg.run.max_staleness == 0
    assert cfg.samples_per_rollout == 16 * 8
    assert cfg.effective_global_batch_size == cfg.samples_per_rollout


def test_negative_staleness_rejected():
    with pytest.raises(ValidationError):
        RelaxConfig.model_validate({"run": {"max_staleness": -1}})


def test_staleness_needs_fully_async():
    with pytest.raises(ValidationError, match="--max-staleness"):
        RelaxConfig.model_validate({"run": {"max_staleness": 1}})
    cfg = RelaxConfig.model_validate({"run": {"max_staleness": 2, "mode": "fully_async"}})
    assert cfg.run.max_staleness == 2


def test_global_batch_must_divide_rollout_samples():
    ok = RelaxConfig.model_validate(
        {"rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 3}, "train": {"global_batch_size": 6}}
    )
    assert ok.effective_global_batch_size == 6
    with pytest.raises(ValidationError, match="--global-batch-size"):
        RelaxConfig.model_validate(
            {
                "rollout": {"rollout_batch_size": 4, "n_samples_per_prompt": 3},
                "train": {"global_batch_size": 5},
            }
        )


def test_prompt_data_and_checkpoint_go_together():
    with pytest.raises(ValidationError, match="--hf-checkpoint"):
        RelaxConfig.model_validate({"data": {"prompt_data": "x.jsonl"}})
    with pytest.raises(ValidationError, match="--prompt-data"):
        RelaxConfig.model_validate({"model": {"hf_checkpoint": "/m"}})
    cfg = RelaxConfig.model_validate({"data": {"prompt_data": "x.jsonl"}, "model": {"hf_checkpoint": "/m"}})
    assert not cfg.is_demo


def test_distributed_optimizer_needs_the_megatron_backend():
    with pytest.raises(ValidationError, match="--train-backend megatron"):
        RelaxConfig.model_validate({"train": {"use_distributed_optimizer": True}})
    cfg = RelaxConfig.model_validate(
        {"train": {"use_distributed_optimizer": True, "train_backend": "megatron"}}
    )
    assert cfg.train.use_distributed_optimizer


def test_unknown_field_rejected():
    with pytest.raises(ValidationError):
        RelaxConfig.model_validate({"train": {"learning_rate": 1e-3}})


def test_assignment_is_validated():
    cfg = RelaxConfig()
    with pytest.raises(ValidationError):
        cfg.train.lr = -1.0


def test_role_nodes_take_pairs_or_a_mapping_and_need_fully_async():
    """--role-nodes (#40): 'role=address,...' or a mapping; malformed pairs and colocate runs are refused,
    naming the fix; unknown roles are refused where the run's roles are known (NodePlacement)."""
    from relax_app.cli_config import ConfigError, build_config

    cfg = build_config(None, ["--fully-async", "--role-nodes", "rollout=10.0.0.2, actor=10.0.0.3"])
    assert cfg.run.role_nodes == {"rollout": "10.0.0.2", "actor": "10.0.0.3"}
    cfg = build_config(None, ["--fully-async", "--role-nodes", "{rollout: 10.0.0.2}"])
    assert cfg.run.role_nodes == {"rollout": "10.0.0.2"}
    with pytest.raises(ConfigError, match="ROLE=ADDRESS pairs .*'rollout'"):
        build_config(None, ["--fully-async", "--role-nodes", "rollout"])
    with pytest.raises(ConfigError, match="--role-nodes .*add --fully-async"):
        build_config(None, ["--role-nodes", "rollout=10.0.0.2"])
    assert build_config(None, ["--ray-address", "10.0.0.1:6379"]).run.ray_address == "10.0.0.1:6379"


def test_node_placement_refuses_unknown_roles_and_absent_nodes():
    """On a real (one-node) Ray cluster: a role not in the run, and a node not in the cluster, are refused
    naming what there is; a role whose node is gone goes on the driver's."""
    ray = pytest.importorskip("ray")
    from relax_core.placement import NodePlacement

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        with pytest.raises(ValueError, match=r"names \['critic'\], not roles of this run; its roles are"):
            NodePlacement(ray, {"critic": "10.0.0.2"}, ["actor", "rollout"])
        nodes = NodePlacement(ray, {"rollout": "203.0.113.7"}, ["actor", "rollout"])
        here = nodes.driver_address
        with pytest.raises(ValueError, match=rf"\['203.0.113.7'\] that are not alive .*\['{here}'\]"):
            nodes.check()
        assert nodes.strategy("rollout").node_id == ray.get_runtime_context().get_node_id()
        assert nodes.placed == {"rollout": here}
    finally:
        if started:
            ray.shutdown()
