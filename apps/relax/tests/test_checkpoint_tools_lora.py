"""`relax export` / `relax eval` on a LoRA run's checkpoint (#37): with --lora-save-merged it serves its
model_merged/; without, the adapter is merged into the model the run trained from, the checkpoint untouched."""

from __future__ import annotations

import os

import pytest

from relax_core.checkpoints import write_manifest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")


@pytest.mark.parametrize("saved_merged", [False, True], ids=["adapter-only", "with-model-merged"])
def test_export_of_a_lora_checkpoint_serves_the_merged_policy(tmp_path, saved_merged):
    from transformers import AutoModelForCausalLM

    from relax_app.checkpoint_tools import export
    from relax_core.config import RelaxConfig
    from relax_core.lora import merged_weights
    from relax_testing import build_tiny_checkpoint
    from relax_train.backends.torch_backend import TorchBackend

    base = build_tiny_checkpoint(tmp_path / "base")
    cfg = RelaxConfig(
        model={"hf_checkpoint": base},
        data={"prompt_data": str(tmp_path / "prompts.jsonl")},
        lora={"lora_rank": 4, "lora_save_merged": saved_merged},
    )
    be = TorchBackend(cfg, base)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a trained adapter (B = 0 would merge to the base itself)
        for p in be.model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    ckpt = tmp_path / "ckpt"
    be.save_checkpoint(ckpt)
    write_manifest(ckpt)  # (as a run's save does: save_atomically)
    before = sorted(p.name for p in ckpt.iterdir())
    assert not (ckpt / "model").exists() and (ckpt / "model_merged").is_dir() == saved_merged

    old_umask = os.umask(0o022)
    try:
        source = export(ckpt, tmp_path / "hf")
    finally:
        os.umask(old_umask)
    # where the tokenizer came from, as `relax export` prints it: the base (the merge's temporary directory
    # it named before is deleted at exit); the weights readable as the umask makes new files (were 0600)
    assert source == (str(tmp_path / "ckpt" / "model_merged") if saved_merged else base)
    assert (tmp_path / "hf" / "model.safetensors").stat().st_mode & 0o777 == 0o644
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    want = dict(merged_weights(be.model))
    for name, t in served.state_dict().items():
        if name in want:
            torch.testing.assert_close(t, want[name], atol=1e-6, rtol=1e-6)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert sorted(p.name for p in ckpt.iterdir()) == before  # the checkpoint is left as it was
