"""MoE experts fused (transformers 5 in memory, what the trainers export) and one per expert (checkpoints,
SGLang's loaders): the split is the hub layout transformers itself reads, and the torch engine takes both."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relax_rollout.engines import SamplingParams  # noqa: E402
from relax_rollout.engines.expert_names import fuse_experts, unfuse_experts  # noqa: E402
from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402
from relax_rollout.engines.wire_weights import save_safetensors  # noqa: E402
from relax_testing import tiny_moe  # noqa: E402

EXPERTS, FFN, H = 8, 16, 32  # (2 * FFN != H, FFN != H: no layout reads the wrong one by accident)


def _model(seed=0):
    return tiny_moe(seed=seed, moe_intermediate_size=FFN)


def test_per_expert_names_are_the_checkpoint_layout_transformers_reads(tmp_path):
    """Split a model's fused experts, save them as a checkpoint: transformers loads it (through its own
    per-expert → fused conversion) into exactly the same model."""
    model = _model()
    state = model.state_dict()
    fused = [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused and state[fused[0]].shape in ((EXPERTS, 2 * FFN, H), (EXPERTS, H, FFN))
    split = dict(unfuse_experts(state.items()))
    assert not set(fused) & set(split)
    assert split["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (FFN, H)
    assert split["model.layers.0.mlp.experts.3.up_proj.weight"].shape == (FFN, H)
    assert split["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (H, FFN)
    save_safetensors(split, str(tmp_path))  # (views of the fused tensors: saved as copies)
    model.config.save_pretrained(tmp_path)
    loaded = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path)
    for name, value in loaded.state_dict().items():
        torch.testing.assert_close(value, state[name], msg=name)


def test_fuse_is_the_inverse_and_names_what_is_missing():
    state = _model().state_dict()
    split = dict(unfuse_experts(state.items()))
    back = fuse_experts(split, state)
    assert set(back) == set(state)
    for name, value in state.items():
        assert torch.equal(back[name], value), name
    split.pop("model.layers.1.mlp.experts.5.up_proj.weight")
    with pytest.raises(
        KeyError, match=r"layers\.1\.mlp\.experts\.gate_up_proj: experts \['5\.up_proj'\] missing"
    ):
        fuse_experts(split, state)


def test_torch_engine_takes_per_expert_updates():
    """Our engine server's engine loads the per-expert update the sglang engine sends: the same policy as
    the fused update."""
    torch.set_num_threads(1)
    new = _model(seed=1).state_dict()
    prompts, greedy = [[3, 12, 4, 13], [7, 8]], SamplingParams(max_new_tokens=5, greedy=True)
    a = TorchEngine(model=_model(), eos_token_ids=[1], pad_token_id=0)
    b = TorchEngine(model=_model(), eos_token_ids=[1], pad_token_id=0)
    before = [o.token_ids for o in a.generate(prompts, greedy)]
    a.update_weights(new, 1)
    b.update_weights(dict(unfuse_experts(new.items())), 1)
    outs_a, outs_b = a.generate(prompts, greedy), b.generate(prompts, greedy)
    assert [o.token_ids for o in outs_a] == [o.token_ids for o in outs_b] != before
    for x, y in zip(outs_a, outs_b):
        assert x.log_probs == pytest.approx(y.log_probs, abs=1e-6)
    assert a.weights_checksum() == b.weights_checksum()
