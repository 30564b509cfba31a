"""RolloutWorker with --routing-replay: samples carry the engine's ``routed_experts``; backends that cannot
record and dense models are refused with the flag's name."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_bus import DataBus  # noqa: E402
from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.controller import bus_config  # noqa: E402
from relax_rollout.worker import RolloutWorker  # noqa: E402
from relax_testing import tiny_moe  # noqa: E402


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dir, tmp_path_factory):
    """A tiny Qwen3-MoE with the tiny checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = tiny_moe(
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        norm_topk_prob=False,  # (transformers' defaults, not tiny_moe's)
        initializer_range=0.02,
    )
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "12+3=", "label": "15"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def make_cfg(model_dir, prompt_file, **rollout) -> RelaxConfig:
    r = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 4, **rollout}
    return RelaxConfig.model_validate(
        {
            "model": {"hf_checkpoint": model_dir},
            "data": {"prompt_data": prompt_file},
            "rollout": r,
            "algo": {"routing_replay": True},
        }
    )


def test_samples_carry_the_routing_of_their_tokens(moe_dir, prompt_file):
    cfg = make_cfg(moe_dir, prompt_file)
    bus = DataBus(bus_config(cfg))
    worker = RolloutWorker(cfg, bus, moe_dir, prompt_file, torch_threads=1)
    worker.produce(step=0)
    data = bus.get("advantages", cfg.samples_per_rollout, timeout=5).data
    for tokens, routed in zip(data["tokens"], data["routed_experts"]):
        assert routed.dtype == np.int16 and routed.shape == (len(tokens) - 1, 2, 2)
        assert routed.min() >= 0 and routed.max() < 8


def test_refused_for_other_backends_and_dense_models(moe_dir, tiny_model_dir, prompt_file):
    cfg = make_cfg(
        moe_dir, prompt_file, rollout_backend="external", rollout_external_urls=["http://127.0.0.1:9"]
    )
    with pytest.raises(ValueError, match="--routing-replay needs --rollout-backend torch or sglang"):
        RolloutWorker(cfg, DataBus(bus_config(cfg)), moe_dir, prompt_file, torch_threads=1)
    cfg = make_cfg(tiny_model_dir, prompt_file)
    with pytest.raises(ValueError, match="--routing-replay needs an MoE model"):
        RolloutWorker(cfg, DataBus(bus_config(cfg)), tiny_model_dir, prompt_file, torch_threads=1)
