"""`relax prepare-model omni-thinker SRC DST`: a whole Qwen3-Omni checkpoint's thinker saved alone.

Why: RL trains Qwen3-Omni's thinker (the talker only speaks), and the trainers take a checkpoint of the
model they train; SGLang serves only the whole model (it registers ``Qwen3OmniMoeForConditionalGeneration``).
So the Omni recipe gives the trainer this thinker (``--hf-checkpoint``) and SGLang the whole checkpoint
(``--sglang-model-path``); weight updates go back under the whole model's ``thinker.`` names.

The weights are copied shard by shard (``thinker.*`` tensors, the prefix dropped; the talker's and
code2wav's left out), so a 30B checkpoint needs one shard's memory, not the model's. The config is the
whole model's ``thinker_config``; tokenizer and processor files are copied, and the chat template, which
Qwen3-Omni keeps in ``chat_template.json``, is also put in ``tokenizer_config.json`` (where the tokenizer
reads it).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from relax_core.hf_files import share_as_new_files

PREFIX = "thinker."
WEIGHT_FILES = ("config.json", "model.safetensors.index.json")


class ModelError(ValueError):
    pass


def omni_thinker(src: str | Path, dst: str | Path) -> Path:
    """Write the thinker of the whole Qwen3-Omni checkpoint ``src`` to ``dst``; returns ``dst``."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    src, dst = Path(src), Path(dst)
    cfg_file = src / "config.json"
    if not cfg_file.is_file():
        raise ModelError(f"{src}: no config.json (expected a Qwen3-Omni checkpoint directory)")
    model_type = json.loads(cfg_file.read_text()).get("model_type")
    if model_type != "qwen3_omni_moe":
        raise ModelError(
            f"{src}: model_type {model_type!r}, not a whole Qwen3-Omni checkpoint ('qwen3_omni_moe')"
            + (": it is a thinker already, use it as it is" if model_type == "qwen3_omni_moe_thinker" else "")
        )
    index = src / "model.safetensors.index.json"
    shards = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.is_file()
        else ["model.safetensors"]
    )
    missing = [s for s in shards if not (src / s).is_file()]
    if missing:
        raise ModelError(f"{src}: weight files {missing[:3]} are missing (an incomplete download?)")
    if dst.resolve() == src.resolve():
        raise ModelError(f"{dst}: write the thinker to another directory than the whole model's")
    dst.mkdir(parents=True, exist_ok=True)

    def thinker_keys(shard: str) -> list[str]:
        with safe_open(src / shard, "pt") as f:
            return [k for k in f.keys() if k.startswith(PREFIX)]

    kept = [(s, keys) for s in shards if (keys := thinker_keys(s))]  # (names only: nothing loaded yet)
    weight_map: dict[str, str] = {}
    total = 0
    for i, (shard, keys) in enumerate(kept, start=1):  # one shard's tensors in memory at a time
        with safe_open(src / shard, "pt") as f:
            tensors = {k[len(PREFIX) :]: f.get_tensor(k) for k in keys}
        name = f"model-{i:05d}-of-{len(kept):05d}.safetensors"
        save_file(tensors, dst / name, metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    if not weight_map:
        raise ModelError(f"{src}: no {PREFIX}* weights found")
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )

    whole = AutoConfig.from_pretrained(src)
    thinker = whole.thinker_config
    thinker.architectures = ["Qwen3OmniMoeThinkerForConditionalGeneration"]
    if getattr(thinker, "dtype", None) is None:  # (the hub keeps it on the whole model's config only)
        thinker.dtype = getattr(whole, "dtype", None)
    thinker.save_pretrained(dst)
    share_as_new_files(dst)  # (safetensors writes its files 0600)
    for f in src.iterdir():  # tokenizer, processor, chat template, generation config
        if f.is_file() and f.name not in WEIGHT_FILES and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    template, tok_cfg = dst / "chat_template.json", dst / "tokenizer_config.json"
    if template.is_file() and tok_cfg.is_file():
        tok = json.loads(tok_cfg.read_text())
        if not tok.get("chat_template"):
            tok["chat_template"] = json.loads(template.read_text())["chat_template"]
            tok_cfg.write_text(json.dumps(tok, indent=2, ensure_ascii=False))
    return dst


USAGE = """usage: relax prepare-model omni-thinker SRC DST

  omni-thinker   the thinker of a whole Qwen3-Omni checkpoint (SRC, as downloaded) saved alone in DST: what
                 --hf-checkpoint takes for the Omni recipe, while SGLang serves SRC (--sglang-model-path)
"""


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] != "omni-thinker" or len(argv) != 3:
        print(
            f"relax prepare-model: expected `omni-thinker SRC DST`, got {' '.join(argv)!r}\n\n{USAGE}",
            file=sys.stderr,
        )
        return 2
    try:
        out = omni_thinker(argv[1], argv[2])
    except (ModelError, OSError) as e:
        print(f"relax prepare-model: {e}", file=sys.stderr)
        return 1
    print(f"wrote the thinker to {out}")
    return 0
