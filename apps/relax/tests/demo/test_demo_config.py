"""The demos' configs, pinned field by field: the library's defaults are a real run's (slime's and veRL's
values) and may change; the CPU demo and the omni demo set what they rely on themselves, so their behaviour
and results stay as they were. ``demo_configs.json`` holds the configs `relax train` and `relax train
--omni-demo` built when the defaults moved to real-run values (before that commit, byte for byte)."""

import json
from pathlib import Path

import pytest

from relax_app.cli_config import build_config
from relax_app.demo.defaults import DEMO_DEFAULTS
from relax_app.demo.omni import OMNI_DEFAULTS
from relax_core.config import RelaxConfig

PINNED = json.loads((Path(__file__).parent / "demo_configs.json").read_text())

BUILT = {
    # what relax_app.cli builds for `relax train` and `relax train --omni-demo` (its paths, placeholders)
    "demo": lambda: build_config(None, [], defaults=DEMO_DEFAULTS),
    "omni": lambda: build_config(
        None, [], defaults={**OMNI_DEFAULTS, "prompt_data": "OMNI_DATA", "hf_checkpoint": "OMNI_MODEL"}
    ),
}


@pytest.mark.parametrize("demo", sorted(BUILT))
def test_the_demo_config_is_the_pinned_one_field_for_field(demo):
    """A field added since the pin may take any default (the demo did not have it); every pinned field keeps
    its value. A failure names the fields: set the old value in DEMO_DEFAULTS / OMNI_DEFAULTS."""
    built = BUILT[demo]().model_dump(mode="json")
    changed = {
        f"{section}.{name}": (value, built.get(section, {}).get(name, "<gone>"))
        for section, fields in PINNED[demo].items()
        for name, value in fields.items()
        if built.get(section, {}).get(name, "<gone>") != value
    }
    assert changed == {}, f"{demo}: (pinned, now) per field: {changed}"


def test_the_library_defaults_are_a_real_runs_not_the_demos():
    default = RelaxConfig()
    assert default.rollout.rollout_max_response_len >= 512  # (8 trained a user's model on 8-token answers)
    assert (default.train.lr, default.train.weight_decay, default.train.adam_beta2) == (1e-6, 0.01, 0.999)
    demo = PINNED["demo"]
    assert demo["rollout"]["rollout_max_response_len"] == DEMO_DEFAULTS["rollout_max_response_len"] == 6
    assert demo["train"]["lr"] == DEMO_DEFAULTS["lr"] == 2e-4


def test_a_yaml_without_prompt_data_runs_the_demo_with_its_settings(tmp_path, monkeypatch):
    import relax_app.train as launch
    from relax_app.cli import main

    seen = []
    monkeypatch.setattr(launch, "check_inputs", lambda cfg: [])
    monkeypatch.setattr(launch, "train", seen.append)  # (the run itself is not what is tested)
    path = tmp_path / "demo.yaml"
    path.write_text("fully_async: true\nmax_staleness: 1\nnum_rollout: 3\n")
    assert main(["train", str(path)]) == 0
    (cfg,) = seen
    assert cfg.is_demo and (cfg.run.mode, cfg.train.num_rollout) == ("fully_async", 3)  # the YAML's
    assert (cfg.rollout.rollout_max_response_len, cfg.train.lr) == (6, 2e-4)  # and the demo's


@pytest.mark.parametrize(
    "argv, lr",
    [(["--lora-rank", "8"], 1e-3), (["--lora-rank", "8", "--lr", "5e-4"], 5e-4), ([], 2e-4)],
    ids=["lora", "lora-own-lr", "full"],
)
def test_the_demo_with_lora_takes_loras_learning_rate_unless_one_is_given(monkeypatch, argv, lr):
    import relax_app.train as launch
    from relax_app.cli import main

    seen = []
    monkeypatch.setattr(launch, "check_inputs", lambda cfg: [])
    monkeypatch.setattr(launch, "train", seen.append)
    assert main(["train", *argv]) == 0
    (cfg,) = seen
    assert cfg.train.lr == lr and cfg.lora.enabled == bool(argv)


def test_the_agent_demo_trains_the_messages_agent_fully_async(monkeypatch):
    """`relax train --agent-demo`: its own assets (chat-format warm start), the Anthropic-SDK agent, fully
    async; any flag still overrides (here the two-agent demo)."""
    import relax_app.demo.agent_demo as agent_demo
    import relax_app.train as launch
    from relax_app.cli import main

    seen = []
    monkeypatch.setattr(agent_demo, "prepare_agent_demo", lambda cache: ("M", "TRAIN", "HELD_OUT"))
    monkeypatch.setattr(launch, "check_inputs", lambda cfg: [])
    monkeypatch.setattr(launch, "train", seen.append)
    assert main(["train", "--agent-demo"]) == 0
    assert (
        main(
            ["train", "--agent-demo", "--agent-path", agent_demo.TWO_AGENTS, "--agents", "solver", "checker"]
        )
        == 0
    )
    one, two = seen
    assert (one.agent.agent_path, one.agent.agents) == (agent_demo.MESSAGES_AGENT, ["agent"])
    assert (one.model.hf_checkpoint, one.data.prompt_data, one.data.eval_data) == ("M", "TRAIN", "HELD_OUT")
    assert (
        one.run.mode == "fully_async"
        and one.data.apply_chat_template
        and one.run.output_dir == "runs/agent-demo"
    )
    assert (two.agent.agent_path, two.agent.agents) == (agent_demo.TWO_AGENTS, ["solver", "checker"])
    assert two.samples_per_rollout == 2 * one.samples_per_rollout
