"""TorchBackend with LoRA (--lora-rank): only the adapters train and travel, the reference computes the base
through the trainer's own weights, checkpoints hold the adapter in peft's format."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from relax_core.config import RelaxConfig  # noqa: E402
from relax_train.backends.torch_backend import TorchBackend  # noqa: E402

SEQS = [([3, 12, 4, 13], [5, 6, 1]), ([7, 12, 8, 12, 9, 13], [10]), ([4, 13], [3, 3, 3, 3, 1])]


def lora_cfg(model_dir, **lora) -> RelaxConfig:
    return RelaxConfig.model_validate(
        {
            "train": {"micro_batch_size": 2, "lr": 1e-2, "weight_decay": 0.0},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": len(SEQS)},
            "lora": {"lora_rank": 4, **lora},
        }
    )


def samples(seqs=SEQS, adv=(1.0, -1.0, 0.5)):
    out = {"tokens": [], "prompt_len": [], "loss_mask": [], "advantages": [], "rollout_log_probs": []}
    for (p, r), a in zip(seqs, adv):
        out["tokens"].append(np.asarray(p + r, dtype=np.int64))
        out["prompt_len"].append(len(p))
        out["loss_mask"].append(np.ones(len(r), dtype=np.float32))
        out["advantages"].append(np.full(len(r), a, dtype=np.float32))
        out["rollout_log_probs"].append(np.full(len(r), -2.0, dtype=np.float32))
    return out


@pytest.fixture(scope="module")
def trained(tiny_model_dir):
    """A LoRA trainer after one step, and the plain base model's log-probs."""
    base = TorchBackend(lora_cfg(tiny_model_dir), tiny_model_dir, trainable=False, adapter=False)
    be = TorchBackend(lora_cfg(tiny_model_dir, lora_save_merged=True), tiny_model_dir)
    before = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    be.train_step(samples())
    return be, before, base.compute_log_probs(samples())


def test_only_the_adapters_train(trained):
    be, before, _ = trained
    changed = {n for n, p in be.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all(".lora_" in n for n in changed)
    opt = {id(p) for g in be.optimizer.param_groups for p in g["params"]}
    lora = {id(p) for n, p in be.model.named_parameters() if ".lora_" in n}
    assert opt == lora
    assert be.version == 1
    names = [n for n, _ in be.named_weights()]  # adapter mode: the wire format
    assert names and all(n.startswith("base_model.model.") and ".lora_" in n for n in names)


def test_reference_base_view_equals_the_base_model(trained):
    be, _, base_lp = trained
    view = be.base_view()
    got = view.compute_log_probs(samples())
    for a, b in zip(got, base_lp):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert view.version == 0
    trained_lp = be.compute_log_probs(samples())  # the adapters are back on afterwards
    assert max(float(np.abs(a - b).max()) for a, b in zip(trained_lp, base_lp)) > 1e-4


def test_frozen_backends_wrap_only_in_adapter_mode(tiny_model_dir):
    assert (
        TorchBackend(lora_cfg(tiny_model_dir), tiny_model_dir, trainable=False, adapter=True).lora is not None
    )
    merged = TorchBackend(lora_cfg(tiny_model_dir, lora_sync_mode="merged"), tiny_model_dir, trainable=False)
    assert merged.lora is None
    with pytest.raises(ValueError, match="--lora-rank"):
        merged.base_view()


def test_checkpoint_round_trip(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    be = trained[0]
    be.save_checkpoint(tmp_path)
    assert not (tmp_path / "model").exists()
    assert json.loads((tmp_path / "meta.json").read_text())["lora"]["r"] == 4
    lp = be.compute_log_probs(samples())
    # peft's own loader reads adapter/
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), tmp_path / "adapter"
    )
    ids = torch.tensor([SEQS[0][0] + SEQS[0][1]])
    torch.testing.assert_close(peft_model(ids).logits, be.model(ids).logits, atol=1e-5, rtol=1e-5)
    # model_merged/ serves without peft and equals the merged weights
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model_merged")
    want = dict(be.named_weights() if be.lora.lora_sync_mode == "merged" else _merged(be))
    assert all(torch.equal(want[n], p) for n, p in merged.named_parameters())
    assert (tmp_path / "model_merged" / "tokenizer_config.json").is_file()
    # a fresh trainer resumes the adapter and the optimizer exactly
    again = TorchBackend(lora_cfg(tiny_model_dir), tiny_model_dir)
    meta = again.load_checkpoint(tmp_path)
    assert meta["version"] == again.version == 1
    for a, b in zip(again.compute_log_probs(samples()), lp):
        np.testing.assert_array_equal(a, b)
    s1, s2 = be.optimizer.state_dict(), again.optimizer.state_dict()
    assert s1["state"].keys() == s2["state"].keys()
    for k in s1["state"]:
        assert all(torch.equal(s1["state"][k][f], s2["state"][k][f]) for f in ("exp_avg", "exp_avg_sq"))
    # a backend without adapters refuses it, naming the flag
    plain = RelaxConfig.model_validate({"train": {"micro_batch_size": 2}})
    with pytest.raises(ValueError, match="--lora-rank 4"):
        TorchBackend(plain, tiny_model_dir).load_checkpoint(tmp_path)


def _merged(be):
    from relax_core.lora import merged_weights

    return merged_weights(be.model)


def test_moe_expert_adapters_train(tmp_path):
    from relax_testing import tiny_moe

    model_dir = str(tmp_path)
    tiny_moe(layers=1).save_pretrained(model_dir)
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    cfg = lora_cfg(model_dir, lora_target_modules=["q_proj"], lora_target_parameters=experts)
    be = TorchBackend(cfg, model_dir)
    before = {n: p.detach().clone() for n, p in be.model.named_parameters()}
    be.train_step(samples())
    changed = {n for n, p in be.model.named_parameters() if not torch.equal(before[n], p)}
    assert any("experts" in n for n in changed) and all(".lora_" in n for n in changed)
    fwd = TorchBackend(cfg, model_dir, trainable=False, adapter=True)
    fwd.load_weights(dict(be.named_weights()), be.version)
    for a, b in zip(fwd.compute_log_probs(samples()), be.compute_log_probs(samples())):
        np.testing.assert_array_equal(a, b)


def test_an_adapter_on_the_lm_head_counts_in_the_log_probs_and_trains(tiny_model_dir):
    """``--lora-target-modules`` naming ``lm_head``: the chunked scoring read the head's base weight alone,
    so log-probs left the head's adapter out and it never got a gradient."""
    cfg = lora_cfg(tiny_model_dir, lora_target_modules=["q_proj", "v_proj", "lm_head"])
    be = TorchBackend(cfg, tiny_model_dir, trainable=False, adapter=True)
    with torch.no_grad():
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    s = samples()
    got = be.compute_log_probs(s)
    for tokens, n_prompt, lp in zip(s["tokens"], s["prompt_len"], got):
        with torch.no_grad():
            logits = be.model(input_ids=torch.as_tensor(tokens[None, :-1])).logits[0].float()
        want = torch.log_softmax(logits, -1)[n_prompt - 1 :].gather(
            1, torch.as_tensor(tokens[n_prompt:])[:, None]
        )
        np.testing.assert_allclose(lp, want[:, 0].numpy(), atol=1e-5)
    trainer = TorchBackend(cfg, tiny_model_dir)
    trainer.train_step(samples())
    head = [p for n, p in trainer.model.named_parameters() if "lm_head.lora_B" in n]
    assert head and all(bool(p.abs().sum() > 0) for p in head)  # (B starts at 0: it moved)
