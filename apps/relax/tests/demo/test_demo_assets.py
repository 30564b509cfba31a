import json

from transformers import AutoModelForCausalLM, AutoTokenizer

from relax_app.demo import DemoSettings, prepare_demo

TASK = dict(max_operand=9, n_eval=10, sft_steps=4, sft_batch_size=8, eval_samples=2)
MODEL = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
TINY = {**TASK, **MODEL}  # demo settings that build in seconds: a 4-step warm start of a 1-layer Qwen3


def test_prepare_demo_builds_then_hits_the_cache(tmp_path):
    first = prepare_demo(tmp_path, seed=0, **TINY)
    assert not first.cached
    for d in (first.base_model_dir, first.sft_model_dir):
        AutoModelForCausalLM.from_pretrained(d)
        AutoTokenizer.from_pretrained(d)
    assert first.train_path.is_file() and first.eval_path.is_file()
    manifest = json.loads((first.sft_model_dir.parent / "manifest.json").read_text())
    assert manifest["settings"]["sft_steps"] == 4 and manifest["sft_greedy_accuracy"] == first.sft_accuracy

    second = prepare_demo(tmp_path, seed=0, **TINY)
    assert second.cached and second == first.__class__(**{**first.__dict__, "cached": True})
    assert [p.name for p in tmp_path.iterdir()] == [DemoSettings(**TINY).key()]  # no temp dirs left


def test_any_setting_changes_the_key():
    assert DemoSettings(sft_steps=1).key() != DemoSettings(sft_steps=2).key()
    assert DemoSettings().key() == DemoSettings().key()
