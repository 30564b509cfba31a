"""LoRA's flags (#37): the names TRL, veRL and slime users type, and the combinations refused before any
model loads, each in one line naming what to change."""

from __future__ import annotations

import pytest

from relax_app.cli_config import ConfigError, build_config, help_text
from relax_core.lora import peft_config_dict


def test_lora_is_off_by_default_and_on_with_a_rank():
    assert not build_config(argv=[]).lora.enabled
    cfg = build_config(argv=["--lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj"])
    assert cfg.lora.enabled and cfg.lora.lora_target_modules == ["q_proj", "v_proj"]
    d = peft_config_dict(cfg.lora)
    assert (d["r"], d["lora_alpha"], d["target_modules"], d["peft_type"]) == (
        8,
        16,
        ["q_proj", "v_proj"],
        "LORA",
    )
    assert peft_config_dict(build_config(argv=["--lora-rank", "4"]).lora)["target_modules"] == "all-linear"


@pytest.mark.parametrize(
    "argv",
    [
        ["--use_peft", "--lora_r", "8", "--lora_target_modules", "q_proj", "v_proj"],  # TRL
        ["--lora-rank", "8", "--target-modules", "q_proj", "v_proj"],  # veRL's model.target_modules
        ["--use-lora", "--lora-rank", "8", "--lora-target-modules", '["q_proj", "v_proj"]'],  # slime
    ],
    ids=["trl", "verl", "slime"],
)
def test_other_frameworks_spellings_set_the_same_config(argv):
    lora = build_config(argv=argv).lora
    assert (lora.lora_rank, lora.lora_target_modules) == (8, ["q_proj", "v_proj"])


def test_slimes_sync_mode_names_are_ours():
    argv = ["--lora-rank", "8", "--lora-rollout-sync-mode", "native_adapter"]
    assert build_config(argv=argv).lora.lora_sync_mode == "adapter"
    argv[-1] = "merged"
    assert build_config(argv=argv).lora.lora_sync_mode == "merged"


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--lora-alpha", "32"], "--lora-alpha set but LoRA is off: add --lora-rank N"),
        (["--use-peft"], "add --lora-rank"),
        (["--lora-rank", "8", "--train-backend", "megatron"], "megatron-core (0.16) has no LoRA layers"),
        (["--lora-rank", "-1"], "lora-rank"),
        (
            ["--lora-rank", "8", "--lora-target-modules", "[]"],
            "nothing would train",
        ),
        (["--lora-rank", "8", "--lora-save-merged-hf", "/x"], "give --lora-save-merged instead"),
    ],
    ids=["alpha-without-rank", "use-peft-without-rank", "megatron", "negative", "no-targets", "slime-dir"],
)
def test_a_bad_lora_config_is_one_clear_line(argv, says):
    with pytest.raises(ConfigError) as e:
        build_config(argv=argv)
    assert says in str(e.value) and "\n" not in str(e.value).strip()


def test_help_shows_the_lora_flags_with_trl_and_verl_names():
    text = help_text(width=100)
    assert "LoRA (adapters, not full fine-tuning):" in text
    assert "--lora-rank / --lora-r" in text and "--lora-target-modules / --target-modules" in text
    assert "--use-peft accepted with --lora-rank" in text and "--use-lora accepted with --lora-rank" in text
