"""--rollout-stop / --rollout-stop-token-ids in training rollouts (slime's flags): a response ends with the
token that completes a stop string (kept, scored and trained on like EOS), and never runs past one."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_bus import DataBus  # noqa: E402
from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.controller import bus_config  # noqa: E402
from relax_rollout.worker import RolloutWorker  # noqa: E402
from relax_testing import VOCAB  # noqa: E402

STOPS = list(
    "abcdefghijklm"
)  # (half the tiny model's letters: an untrained model hits one within a few tokens)
MAX_LEN = 16


def _produce(tiny_model_dir, tmp_path, **rollout) -> dict:
    path = tmp_path / "train.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) for a in range(4)) + "\n"
    )
    r = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "rollout_max_response_len": MAX_LEN, **rollout}
    cfg = RelaxConfig.model_validate(
        {"model": {"hf_checkpoint": tiny_model_dir}, "data": {"prompt_data": str(path)}, "rollout": r}
    )
    bus = DataBus(bus_config(cfg))
    worker = RolloutWorker(cfg, bus, tiny_model_dir, str(path), torch_threads=1)
    try:
        worker.produce(step=0)
        return bus.get("advantages", cfg.samples_per_rollout, timeout=5).data
    finally:
        worker.close()


def _responses(data) -> list[list[int]]:
    return [list(t[p:]) for t, p in zip(data["tokens"], data["prompt_len"])]


def test_training_responses_end_at_a_stop_string(tiny_model_dir, tmp_path):
    data = _produce(tiny_model_dir, tmp_path, rollout_stop=STOPS)
    stopped = 0
    for response, reason, mask in zip(_responses(data), data["finish_reason"], data["loss_mask"]):
        text = [VOCAB[t] for t in response]
        assert not any(c in STOPS for c in text[:-1]), text  # (none runs past a stop string)
        assert len(mask) == len(response)  # the stop token is trained on
        if text[-1] in STOPS:
            stopped += 1
            assert reason == "stop"
    assert stopped >= len(data["tokens"]) // 2  # (and they did stop: most of 16 samples within 16 tokens)


def test_training_responses_end_at_a_stop_token_id(tiny_model_dir, tmp_path):
    ids = [VOCAB.index(c) for c in STOPS]
    data = _produce(tiny_model_dir, tmp_path, rollout_stop_token_ids=ids)
    responses = _responses(data)
    assert all(not set(r[:-1]) & set(ids) for r in responses)
    assert sum(r[-1] in ids for r in responses) >= len(responses) // 2
