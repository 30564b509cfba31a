"""`relax prepare-model omni-thinker`: a whole Qwen3-Omni checkpoint (a tiny one, written here as the hub
lays it out: `thinker.*`, `talker.*`, `code2wav.*` tensors over several shards) to its thinker alone, and
the names the sglang engine sends back to a server of the whole model."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relax_app.cli import main as cli  # noqa: E402
from relax_app.recipes.thinker import ModelError, omni_thinker  # noqa: E402
from relax_testing import tiny_omni_thinker_config  # noqa: E402

THINKER = tiny_omni_thinker_config(
    vision={"deepstack_visual_indexes": [1]}, text={"moe_intermediate_size": 16}
)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """(directory of a whole Qwen3-Omni checkpoint, its thinker's state dict)."""
    from safetensors.torch import save_file

    src = tmp_path_factory.mktemp("omni_whole")
    cfg = transformers.Qwen3OmniMoeConfig(thinker_config=THINKER)
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    cfg.dtype = torch.bfloat16  # (on the whole model's config only, as on the hub)
    cfg.save_pretrained(src)
    torch.manual_seed(0)
    thinker = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg.thinker_config)
    state = {k: v.clone() for k, v in thinker.state_dict().items()}
    names = sorted(state)
    shards = {
        "model-00001-of-00003.safetensors": {f"thinker.{k}": state[k] for k in names[: len(names) // 2]},
        "model-00002-of-00003.safetensors": {
            "talker.model.norm.weight": torch.ones(8),
            "code2wav.pre_conv.weight": torch.ones(2, 2),
        },
        "model-00003-of-00003.safetensors": {f"thinker.{k}": state[k] for k in names[len(names) // 2 :]},
    }
    for file, tensors in shards.items():
        save_file(tensors, src / file)
    weight_map = {k: file for file, tensors in shards.items() for k in tensors}
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    (src / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (src / "preprocessor_config.json").write_text(json.dumps({"feature_size": 128}))
    return src, state


def test_the_thinker_saved_alone_loads_as_the_thinker(whole, tmp_path, capsys):
    src, state = whole
    dst = tmp_path / "thinker"
    assert cli(["prepare-model", "omni-thinker", str(src), str(dst)]) == 0
    assert "wrote the thinker" in capsys.readouterr().out
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(state) and len(set(index.values())) == 2  # the talker's shard is gone
    cfg = json.loads((dst / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"], cfg["dtype"]) == (
        "qwen3_omni_moe_thinker",
        ["Qwen3OmniMoeThinkerForConditionalGeneration"],
        "bfloat16",
    )
    loaded = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        dst, dtype=torch.float32
    )
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[name], msg=name)
    tok = json.loads((dst / "tokenizer_config.json").read_text())
    assert tok == {"model_max_length": 1024, "chat_template": TEMPLATE}  # where the tokenizer reads it
    assert (dst / "preprocessor_config.json").is_file()


def test_updates_to_sglang_serving_the_whole_model_use_its_names(whole):
    """SGLang serves the whole model: the trainer's thinker weights go under `thinker.`, experts one per
    expert, exactly as the whole checkpoint on the hub names them."""
    from relax_rollout.engines.checkpoint import checkpoint_config, served_prefix
    from relax_rollout.engines.expert_names import unfuse_experts
    from relax_rollout.engines.sglang.weights import served_names

    src, state = whole
    assert served_prefix(checkpoint_config(str(src))) == "thinker."
    served = dict(served_names(state.items(), served_prefix(checkpoint_config(str(src)))))
    hub = {"thinker." + k for k, _ in unfuse_experts(state.items())}
    assert set(served) == hub
    assert "thinker.model.layers.0.mlp.experts.3.down_proj.weight" in served
    assert "thinker.audio_tower.conv2d1.weight" in served and "thinker.lm_head.weight" in served


def test_what_is_not_a_whole_omni_checkpoint_is_refused(whole, tmp_path, capsys):
    src, _ = whole
    dst = tmp_path / "thinker"
    omni_thinker(src, dst)
    with pytest.raises(ModelError, match="a thinker already"):
        omni_thinker(dst, tmp_path / "again")
    with pytest.raises(ModelError, match="another directory"):
        omni_thinker(src, src)
    (dst / "model-00002-of-00002.safetensors").unlink()
    (dst / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe"}))
    assert cli(["prepare-model", "omni-thinker", str(dst), str(tmp_path / "x")]) == 1
    assert "model-00002-of-00002.safetensors" in capsys.readouterr().err
    assert cli(["prepare-model", "other", "a", "b"]) == 2
