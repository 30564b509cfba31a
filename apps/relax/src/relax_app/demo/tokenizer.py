"""A byte-level BPE tokenizer trained locally (no model hub), saved as a normal HF tokenizer.

Why digits are split one per token: a model that must add "4729" as "47"+"29" has to learn a
separate table per chunk; one digit per token makes addition a per-position skill a tiny model can
learn (the usual choice for arithmetic). Byte-level BPE means any text round-trips exactly.

Special tokens follow Qwen: ``<|endoftext|>`` pads, ``<|im_end|>`` ends an answer (EOS), and a
Qwen-style chat template lets ``apply_chat_template`` work as it does for a real Qwen3 checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, EOS_TOKEN]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], out_dir: str | Path | None = None, vocab_size: int = 320):
    """Train the tokenizer on ``texts``; save it to ``out_dir`` when given. Returns a
    ``PreTrainedTokenizerFast`` (loadable later with ``AutoTokenizer.from_pretrained(out_dir)``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(str(out_dir))
    return fast
