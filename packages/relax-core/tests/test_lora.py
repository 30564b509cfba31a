"""relax_core.lora: peft's adapters on our models, the adapter update's wire format, merged weights that
leave the model alone, and target checks that refuse a typo before any model loads."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from relax_core import lora as L  # noqa: E402
from relax_core.config_lora import LoraConfig  # noqa: E402
from relax_testing import build_tiny_checkpoint, tiny_moe, tiny_qwen3_config, tiny_vision_config  # noqa: E402

X = torch.tensor([[3, 4, 5, 6, 7]])
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3"))


def _train_adapters(model, seed=1):
    """Random adapter values (B = 0 at first would make every delta zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _plain_with(make, weights):
    model = make()
    result = model.load_state_dict(dict(weights), strict=False)
    assert not result.unexpected_keys
    return model


@pytest.mark.parametrize("moe", [False, True])
def test_merged_weights_compute_what_the_adapted_model_computes(tiny_dir, moe):
    from relax_core.models import load_model

    make = (lambda: tiny_moe(layers=1)) if moe else (lambda: load_model(tiny_dir))
    lora = LoraConfig(lora_rank=4, lora_target_parameters=EXPERTS if moe else [])
    base = make()
    before = {n: p.clone() for n, p in base.named_parameters()}
    model = L.wrap(base, lora)
    assert all(("lora_" in n) == p.requires_grad for n, p in model.named_parameters())
    assert torch.equal(model(X).logits, make()(X).logits)  # B = 0: the base until trained
    _train_adapters(model)
    merged = L.merged_weights(model)
    assert [n for n, _ in merged] == list(before)  # the un-wrapped model's names and order
    plain = _plain_with(make, merged)
    torch.testing.assert_close(plain(X).logits, model(X).logits, atol=1e-5, rtol=1e-5)
    # the model itself is unchanged (no merge_adapter): its base weights are still the loaded ones
    assert all(torch.equal(before[n], p) for n, p in L.base_parameters(model))
    if moe:
        assert any("experts" in n for n in L.adapter_state(model))


def test_adapter_state_round_trip_and_refusals(tiny_dir):
    from relax_core.models import load_model

    lora = LoraConfig(lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    src, dst = L.wrap(load_model(tiny_dir), lora), L.wrap(load_model(tiny_dir), lora)
    _train_adapters(src)
    state = L.adapter_state(src)
    assert all(n.startswith("base_model.model.model.layers.") and "default" not in n for n in state)
    assert {n.split(".")[-3] for n in state} == {"q_proj", "v_proj"}
    L.load_adapter_state(dst, state)
    assert torch.equal(dst(X).logits, src(X).logits)
    with pytest.raises(KeyError, match="unknown.*k_proj"):
        L.load_adapter_state(
            dst, {**state, "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": 0}
        )
    with pytest.raises(KeyError, match="1 missing"):
        L.load_adapter_state(dst, dict(list(state.items())[1:]))
    with pytest.raises(ValueError, match="--lora-rank"):
        L.load_adapter_state(dst, {n: torch.zeros(2, *t.shape[1:]) for n, t in state.items()})


def test_check_targets_refuses_unknown_names_before_loading(tiny_dir, monkeypatch):
    import relax_core.models

    monkeypatch.setattr(relax_core.models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    L.check_targets(tiny_dir, LoraConfig(lora_rank=8))
    L.check_targets(tiny_dir, LoraConfig(lora_rank=8, lora_target_modules=["q_proj", "self_attn.v_proj"]))
    with pytest.raises(ValueError, match=r"\['qproj'\]: no such module.*q_proj"):
        L.check_targets(tiny_dir, LoraConfig(lora_rank=8, lora_target_modules=["q_proj", "qproj"]))
    with pytest.raises(ValueError, match="--lora-target-parameters.*experts"):
        L.check_targets(tiny_dir, LoraConfig(lora_rank=8, lora_target_parameters=EXPERTS))
    with pytest.raises(ValueError, match="--lora-dropout 0"):
        L.check_targets(tiny_dir, LoraConfig(lora_rank=8, lora_dropout=0.1, lora_target_parameters=EXPERTS))


def test_vl_adapters_on_the_language_model_only():
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    cfg = Qwen3VLConfig(text_config=tiny_qwen3_config(), vision_config=tiny_vision_config())
    model = L.wrap(Qwen3VLForConditionalGeneration(cfg), LoraConfig(lora_rank=4))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".language_model." in n for n in names)
    assert any("mlp.down_proj" in n for n in names)


def test_all_linear_on_a_moe_model_leaves_the_router_and_unnamed_experts_frozen():
    """peft's own all-linear on transformers 5 MoE models adds the fused experts and the router's weight
    (a v4-name mapping): a trained router changes which experts tokens go to. Ours: the linear layers, and
    the experts only where --lora-target-parameters names them."""
    adapted = {
        tuple(tp): {
            n.split(".lora_")[0].rsplit(".", 2)[-2:][-1]
            for n in L.adapter_state(
                L.wrap(tiny_moe(layers=1), LoraConfig(lora_rank=4, lora_target_parameters=tp))
            )
        }
        for tp in ([], EXPERTS)
    }
    assert adapted[()] == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert "gate" not in adapted[tuple(EXPERTS)] and "experts" in adapted[tuple(EXPERTS)]


def test_check_targets_refuses_what_peft_cannot_adapt_and_tied_embeddings(tiny_dir, tmp_path):
    """#49: a container (mlp), a norm, rotary or act_fn passed the check and failed inside peft after the
    model loaded; an adapter on lm_head / embed_tokens of a tied model was served merged into the weight
    both share: another model than the one trained, 1.5-5.5 nats per token apart."""
    import json
    import shutil

    for target, kind in [("mlp", "Qwen3MLP"), ("input_layernorm", "Qwen3RMSNorm"), ("act_fn", r"\w+")]:
        with pytest.raises(ValueError, match=f"'{target}' is a {kind}, which peft cannot adapt.*q_proj"):
            L.check_targets(tiny_dir, LoraConfig(lora_rank=8, lora_target_modules=["q_proj", target]))
    L.check_targets(tiny_dir, LoraConfig(lora_rank=8, lora_target_modules=["q_proj", "lm_head"]))  # (untied)
    tied = tmp_path / "tied"
    shutil.copytree(tiny_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    for flags in (
        {"lora_target_modules": ["lm_head"]},
        {"lora_target_modules": ["q_proj", "embed_tokens"]},
        {"lora_target_parameters": ["lm_head.weight"]},
    ):
        with pytest.raises(ValueError, match="ties embed_tokens and lm_head"):
            L.check_targets(tied, LoraConfig(lora_rank=8, **flags))
    L.check_targets(tied, LoraConfig(lora_rank=8))  # (all-linear: peft leaves the output layer out)
    L.check_targets(tied, LoraConfig(lora_rank=8, lora_target_modules=["q_proj", "down_proj"]))


def test_an_adapter_on_a_tied_head_is_served_unmerged_as_trained(tiny_dir, tmp_path):
    """Merged into the weight the LM head shares with the input embeddings, an adapter on the head changed
    the embeddings too: the engine sampled from another model than the trainer's (relax-tinker's sampling
    log-probs were 0.01-0.02 nats per token off its trainer's). Such an adapter is served unmerged."""
    import json
    import shutil

    from relax_core.models import load_model

    tied = tmp_path / "tied"
    shutil.copytree(tiny_dir, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}
    trained = L.wrap(load_model(tied), lora)
    _train_adapters(trained)
    served = L.wrap(load_model(tied), lora)
    serving = L.MergedServing(served)
    assert not serving.merged
    serving.load(L.adapter_state(trained))
    with torch.no_grad():
        torch.testing.assert_close(served(X).logits, trained(X).logits, atol=1e-6, rtol=1e-6)
    untied = L.MergedServing(L.wrap(load_model(tiny_dir), lora))
    assert untied.merged  # (nothing shared: merged, as before)
