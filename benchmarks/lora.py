"""LoRA's sizes on the demo model (#37): bytes per weight sync (adapter vs full weights; as the torch engine
and DCS receive them and as SGLang's ``/load_lora_adapter_from_tensors`` body carries them), the trainer's
AdamW state, and the base-model copy the colocate Reference no longer holds (it computes from the trainer's
weights with the adapter disabled). Sizes, not timings: they do not depend on the machine.

    uv run python benchmarks/lora.py                   # rank 8: all-linear and q_proj/v_proj
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def main() -> None:
    from relax_app.demo.assets import prepare_demo
    from relax_core.config import RelaxConfig
    from relax_rollout.engines.sglang.lora import load_adapter_request, serialize_adapter
    from relax_train.backends.torch_backend import TorchBackend

    assets = prepare_demo(os.environ.get("RELAX_CACHE_DIR", ".relax_cache"))
    model = str(assets.sft_model_dir)
    rows = {}
    for label, lora in [
        ("full fine-tuning", None),
        ("rank 8, all-linear", {"lora_rank": 8}),
        ("rank 8, q_proj v_proj", {"lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}),
        ("rank 8, all-linear, merged sync", {"lora_rank": 8, "lora_sync_mode": "merged"}),
    ]:
        run = {"model": {"hf_checkpoint": model}, "data": {"prompt_data": str(assets.train_path)}}
        cfg = RelaxConfig.model_validate({**run, **({"lora": lora} if lora else {})})
        be = TorchBackend(cfg, model)
        named = be.named_weights()
        params = [p for group in be.optimizer.param_groups for p in group["params"]]
        row = {
            "sync_bytes": nbytes(named),
            "adamw_state_bytes": 2 * sum(p.numel() * p.element_size() for p in params),
            "trainable_params": sum(p.numel() for p in params),
        }
        if lora and cfg.lora.lora_sync_mode == "adapter":
            from relax_core.lora import peft_config_dict

            body = load_adapter_request("v1", peft_config_dict(cfg.lora), serialize_adapter(dict(named)), 1)
            row["sglang_request_bytes"] = len(json.dumps(body))
            row["reference_copy_saved_bytes"] = nbytes(be.base_view().named_weights())
        rows[label] = row
    full = rows["full fine-tuning"]["sync_bytes"]
    print(
        "| setting | bytes per sync | vs full | SGLang request bytes | AdamW state bytes | trainable params |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for label, r in rows.items():
        sg = r.get("sglang_request_bytes")
        print(
            f"| {label} | {r['sync_bytes']:,} | {full / r['sync_bytes']:.1f}× fewer | {f'{sg:,}' if sg else '—'} | "
            f"{r['adamw_state_bytes']:,} | {r['trainable_params']:,} |"
        )
    saved = rows["rank 8, all-linear"]["reference_copy_saved_bytes"]
    print(f"\ncolocate Reference with LoRA: no second base model, {saved:,} bytes not held")
    out = Path("benchmarks/results/lora_sizes.json")
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
