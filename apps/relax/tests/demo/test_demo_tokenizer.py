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
