"""Test helpers for packages built on relax-core: a tiny HF checkpoint any role can load.

torch, transformers and tokenizers are imported inside the function, so importing relax_core stays
light; callers (relax-rollout's and relax-train's tests) have them installed.
"""

from __future__ import annotations

PAD, EOS = "<|endoftext|>", "<|im_end|>"
# 64 tokens: the two specials, digits, '+', '=', and letters as filler so every model id decodes
VOCAB = [PAD, EOS, *"0123456789+=", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWX"]


def build_tiny_checkpoint(path) -> str:
    """Write a ~40k-parameter Qwen3 model and a matching tokenizer to ``path``; returns the path."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS)
    hf_tok.save_pretrained(path)

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=len(VOCAB),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def parity_reward(response: str, label, metadata=None) -> float:
    """1 when the response has an even number of characters: on an untrained model's samples it splits
    most groups and leaves some all-equal, which is what a dynamic-sampling test needs. Importable in every
    Ray worker, unlike a function defined in a test file.

    >>> parity_reward("ab", "x")
    1.0
    """
    return float(len(response) % 2 == 0)
