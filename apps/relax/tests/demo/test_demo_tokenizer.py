from transformers import AutoTokenizer

from relax_app.demo.tokenizer import EOS_TOKEN, PAD_TOKEN, train_tokenizer


def test_round_trip_and_single_digit_tokens(tokenizer):
    for text in ["23+45=", "68", "0+0=0", "99+99=198", "hello, world! é"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    ids = tokenizer("1234567890", add_special_tokens=False)["input_ids"]
    assert len(ids) == 10
    assert [tokenizer.decode([i]) for i in ids] == list("1234567890")


def test_special_tokens_and_chat_template(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert tok.eos_token_id != tok.pad_token_id
    assert tok("12+3=")["input_ids"] == tokenizer("12+3=")["input_ids"]  # no BOS added
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("3<|im_end|>", add_special_tokens=False)["input_ids"]
    assert ids[-1] == tok.eos_token_id and len(ids) == 2


def test_saves_to_out_dir(tmp_path):
    train_tokenizer(["1+1=2"], tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()


def test_conversations_without_tools_render_as_before(tokenizer):
    """The tool branches of the chat template are reached only by tool conversations: every other one
    renders byte for byte as the template before tools did (the demo's cached prompts depend on it)."""
    from relax_app.demo.tokenizer import PLAIN_CHAT_TEMPLATE

    conversations = [
        [{"role": "user", "content": "1+2="}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+30="}],
        [
            {"role": "user", "content": "What is 17+25?"},
            {"role": "assistant", "content": "calc: 17+25"},
            {"role": "tool", "content": "42"},  # relax_core.tools' observation: no tool_call_id
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "<tool_call> é \n"},
        ],
    ]
    for messages in conversations:
        for prompt in (False, True):
            new = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            old = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=prompt, chat_template=PLAIN_CHAT_TEMPLATE
            )
            assert new == old


def test_tools_are_rendered_qwen_style(tokenizer):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "c2"}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c2", "content": "3"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    system, rest = text.split("<|im_end|>\n", 1)
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '{"name": "add"' in system
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert rest == (
        f"<|im_start|>user\n1+2?<|im_end|>\n<|im_start|>assistant\n{one}\n{one}<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
