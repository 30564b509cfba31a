"""LoRA on a real GPU (skipped without CUDA; CI has none: these run on a lent GPU machine, see
``tools/gpu-check``): peft's adapters on CUDA tensors through relax_core.lora — an adapter update loaded into
the torch engine on the device, merged weights computed on the device, a training step of the adapters alone
— each computing what the adapted model computes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe-experts"])
def test_adapters_on_cuda_train_sync_and_merge(tmp_path, moe):
    from relax_core import lora as L
    from relax_core.config_lora import LoraConfig
    from relax_core.models import load_model
    from relax_rollout.engines.torch_engine import TorchEngine
    from relax_testing import build_tiny_checkpoint, tiny_moe

    path = build_tiny_checkpoint(tmp_path / "tiny")
    if moe:
        tiny_moe(layers=1).save_pretrained(path)  # (the same tokenizer, a MoE model)
    lora = LoraConfig(lora_rank=4, lora_target_parameters=EXPERTS if moe else [])
    x = torch.tensor([[3, 4, 5, 6, 7]], device="cuda")
    model = L.wrap(load_model(path), lora).cuda()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen = {n: p.clone() for n, p in L.base_parameters(model)}
    for _ in range(3):  # a few steps: B leaves zero, the adapter changes the output
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(frozen[n], p) for n, p in L.base_parameters(model))  # the base is frozen
    state = L.adapter_state(model)
    assert state and all(t.is_cuda for t in state.values())
    engine = TorchEngine(model_path=path, device="cuda", lora=L.peft_config_dict(lora))
    engine.update_weights(state, version=1)
    model.eval()
    with torch.no_grad():
        want = model(x).logits
        torch.testing.assert_close(engine.model(x).logits, want, atol=1e-5, rtol=1e-5)
        plain = load_model(path).cuda().eval()
        plain.load_state_dict(dict(L.merged_weights(model)), strict=False)
        torch.testing.assert_close(plain(x).logits, want, atol=1e-4, rtol=1e-4)
        with model.disable_adapter():  # the reference: the base model, from the same weights
            torch.testing.assert_close(model(x).logits, load_model(path).cuda().eval()(x).logits)
    assert engine.weight_version == 1
