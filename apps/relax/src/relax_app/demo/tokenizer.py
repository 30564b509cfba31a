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

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The template before tools: :data:`CHAT_TEMPLATE` renders every conversation without tools exactly so."""

TOOLS_PREAMBLE = "# Tools\n\nFunctions you may call, one JSON schema per line:\n<tools>"
TOOLS_HOW = (
    "\n</tools>\n\nTo call one, answer with its name and arguments, one call per tag:\n<tool_call>\n"
    '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
)

# Qwen-style tool use, in three branches that only tool conversations reach: with ``tools`` a system turn
# lists them (merged with the conversation's own system message); an assistant turn's ``tool_calls`` follow
# its text as ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` blocks; ``tool`` results (of an
# OpenAI conversation: with ``tools`` or a ``tool_call_id``) are a user turn of ``<tool_response>`` blocks,
# consecutive ones sharing it. Every other message takes the plain branch, byte for byte the old template.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_PREAMBLE) + " }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(TOOLS_HOW) + " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{% for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' and (tools or message.tool_call_id is defined) %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
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
