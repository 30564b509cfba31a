"""A tiny Qwen3-architecture causal LM built from a config (random weights, no download).

Why Qwen3 and not a toy net: the demo's model goes through exactly the code paths a real
``Qwen/Qwen3-4B`` run takes (HF checkpoint dir, ``AutoModelForCausalLM``, weight names, chat
tokens); only the sizes differ. Defaults give well under a million parameters, which trains in
seconds per hundred steps on 2 CPU cores.

Attention is ``sdpa``: with left-padded batched ``generate`` it gives the same greedy tokens as
unpadded single-prompt decoding on CPU (checked in tests), and it is faster than ``eager``.
"""

from __future__ import annotations

from pathlib import Path

SMALLEST: dict[str, int] = dict(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64
)
"""The smallest shape tests build (:func:`build_tiny_qwen3` keywords): every code path of the real
architecture, a forward in milliseconds."""


def build_tiny_qwen3(
    tokenizer,
    out_dir: str | Path | None = None,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 384,
    max_position_embeddings: int = 64,
    seed: int = 0,
):
    """Return a freshly initialised ``Qwen3ForCausalLM`` sized for ``tokenizer``.

    When ``out_dir`` is given, save model (safetensors) and tokenizer there, so the directory is a
    normal HF checkpoint for ``--hf-checkpoint``.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    pad_id = tokenizer.pad_token_id
    # type: ignore: transformers' dataclass_transform lists the fields only; PreTrainedConfig's
    # @strict(accept_kwargs=True) hands other keywords to __post_init__, which reads attn_implementation
    config = Qwen3Config(  # type: ignore[call-arg]
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        dtype="float32",
        attn_implementation="sdpa",  # (not a field: PreTrainedConfig.__post_init__ takes it)
    )
    torch.manual_seed(seed)
    from relax_core.models import ensure_tied

    # transformers: PreTrainedModel.to is @wraps(nn.Module.to), and typeshed's _Wrapped is no descriptor:
    # mypy does not bind it as a method and takes the dtype for `self`
    model = ensure_tied(Qwen3ForCausalLM(config).to(torch.float32))  # type: ignore[arg-type]
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = pad_id
    if out_dir is not None:
        save_checkpoint(model, tokenizer, out_dir)
    return model


def save_checkpoint(model, tokenizer, out_dir: str | Path) -> Path:
    """Save model (safetensors) and tokenizer into one HF checkpoint directory."""
    from relax_core.hf_files import share_as_new_files

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    share_as_new_files(out)  # (safetensors writes its files 0600)
    return out


def count_parameters(model) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())
