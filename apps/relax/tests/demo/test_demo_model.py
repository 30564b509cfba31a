import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_app.demo.model import build_tiny_qwen3, count_parameters


def test_default_model_is_small_qwen3(tokenizer):
    model = build_tiny_qwen3(tokenizer)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert count_parameters(model) < 5_000_000
    cfg = model.config
    assert cfg.vocab_size == len(tokenizer) and cfg.tie_word_embeddings
    assert cfg.eos_token_id == tokenizer.eos_token_id and cfg.pad_token_id == tokenizer.pad_token_id


def test_save_load_round_trip_through_auto_classes(tokenizer, tmp_path):
    model = build_tiny_qwen3(tokenizer, tmp_path, hidden_size=64, num_layers=2, intermediate_size=128)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "config.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok(["12+7="], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits, atol=1e-5)
    assert loaded.dtype == torch.float32


def test_left_padded_batch_matches_single_prompts(tokenizer):
    """Batched rollouts are left-padded: the padded prompt must score like the unpadded one."""
    model = build_tiny_qwen3(tokenizer, hidden_size=64, num_layers=2, intermediate_size=128).eval()
    tokenizer.padding_side = "left"
    prompts = ["1+2=", "15+16=", "7+19="]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    batch = model.generate(**enc, **kw)
    for i, p in enumerate(prompts):
        single = model.generate(**tokenizer([p], return_tensors="pt"), **kw)
        for step in range(3):
            assert torch.allclose(batch.scores[step][i], single.scores[step][0], atol=1e-4)
