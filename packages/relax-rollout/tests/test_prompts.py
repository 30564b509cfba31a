"""How a prompt becomes the text it is tokenized from (:func:`relax_rollout.prompts.render`): chat messages
through the chat template with their roles, text raw or as one user turn."""

import pytest

from relax_rollout.prompts import messages_of, render

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (continue_final_message and loop.last) %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = TEMPLATE
    return tok


def test_messages_keep_their_roles_with_or_without_apply_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]
    want = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(tokenizer, messages, apply_chat_template=True) == want
    assert render(tokenizer, messages, apply_chat_template=False) == want  # (a list has no other text)


def test_text_is_raw_or_one_user_turn(tokenizer):
    assert render(tokenizer, "1+1=", apply_chat_template=False) == "1+1="
    assert render(tokenizer, "1+1=", apply_chat_template=True) == (
        "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert messages_of("1+1=") == [{"role": "user", "content": "1+1="}]


def test_a_last_assistant_turn_is_continued(tokenizer):
    messages = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1, 2,"}]
    assert render(tokenizer, messages, apply_chat_template=True).endswith("<|im_start|>assistant\n1, 2,")


def test_messages_without_a_chat_template_say_what_to_do(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template: use a chat model's tokenizer"):
        render(tok, [{"role": "user", "content": "hi"}], apply_chat_template=False)
