"""RolloutWorker.produce: one rollout batch of scored, versioned samples written to an in-process bus."""

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from relax_bus import DataBus  # noqa: E402
from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.controller import bus_config  # noqa: E402
from relax_rollout.worker import RolloutWorker  # noqa: E402


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [
        {"prompt": "1+1=", "label": "2"},
        {"prompt": "12+3=", "label": "15"},
        {"prompt": "4+4=", "label": "8"},
        "not json",
    ]
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


def make_worker(tiny_model_dir, prompt_file, **rollout):
    r = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 3,
        "rollout_max_response_len": 5,
        "rm_type": "math",
        **rollout,
    }
    cfg = RelaxConfig.model_validate(
        {"model": {"hf_checkpoint": tiny_model_dir}, "data": {"prompt_data": prompt_file}, "rollout": r}
    )
    bus = DataBus(bus_config(cfg))
    return cfg, bus, RolloutWorker(cfg, bus, tiny_model_dir, prompt_file, torch_threads=1)


def test_produce_writes_one_scored_batch(tiny_model_dir, prompt_file):
    cfg, bus, worker = make_worker(tiny_model_dir, prompt_file)
    worker.produce(step=0)
    n = cfg.samples_per_rollout
    assert bus.stats()["samples_put"] == n == 6
    batch = bus.get("advantages", n, timeout=5)
    data = batch.data
    assert len(data["tokens"]) == n
    groups = data["group_id"]
    assert sorted(set(groups)) == ["0:0", "0:1"]
    assert all(groups.count(g) == 3 for g in set(groups))
    assert set(data["policy_version"]) == {0}
    assert set(data["reward"]) <= {0.0, 1.0}
    assert set(data["rollout_step"]) == {0}
    # the batch's generation speed, on each sample (the trainer logs it as rollout/tokens_per_s)
    gen_s = worker.get_record().stats["generate_s"]
    assert gen_s > 0
    assert data["rollout_tokens_per_s"] == [pytest.approx(sum(data["response_len"]) / gen_s)] * n
    for i in range(n):
        rlen = data["response_len"][i]
        assert 1 <= rlen <= cfg.rollout.rollout_max_response_len
        assert len(data["tokens"][i]) == data["prompt_len"][i] + rlen
        assert len(data["loss_mask"][i]) == rlen
        assert len(data["rollout_log_probs"][i]) == rlen
        assert np.all(np.asarray(data["rollout_log_probs"][i]) <= 0.0)
        assert data["finish_reason"][i] in ("stop", "length")
    # every sample of a group shares its prompt
    by_group = {}
    for g, pid, toks, plen in zip(groups, data["prompt_id"], data["tokens"], data["prompt_len"]):
        by_group.setdefault(g, set()).add((pid, tuple(toks[:plen])))
    assert all(len(v) == 1 for v in by_group.values())
    stats = worker.get_record().stats
    assert stats["samples"] == n and stats["skipped_rows"] == 1


def test_policy_version_follows_weight_updates(tiny_model_dir, prompt_file):
    cfg, bus, worker = make_worker(tiny_model_dir, prompt_file, n_samples_per_prompt=2)
    name, p = worker.generation.engine.named_weights()[0]
    worker.set_weights({name: p.detach().clone()}, version=3)
    assert worker.weight_version() == 3
    worker.produce(step=1)
    data = bus.get("advantages", cfg.samples_per_rollout, timeout=5).data
    assert set(data["policy_version"]) == {3}
    assert set(data["group_id"]) == {"1:0", "1:1"}


def test_correct_answer_scores_one(tiny_model_dir, prompt_file, monkeypatch):
    """The reward sees the decoded response: force the engine to answer '2<eos>' to '1+1='."""
    from relax_rollout.engines import GenerateOutput

    cfg, bus, worker = make_worker(tiny_model_dir, prompt_file, rollout_batch_size=3, n_samples_per_prompt=1)
    tok = worker.tokenizer
    answer = tok("2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def fake_generate(prompts, params):
        return [
            GenerateOutput(answer, [-0.5] * len(answer), "stop", worker.generation.engine.weight_version)
            for _ in prompts
        ]

    monkeypatch.setattr(worker.generation.engine, "generate", fake_generate)
    worker.produce(step=0)
    data = bus.get("advantages", 3, timeout=5, partial=True).data
    rewards = {text: r for text, r in zip(data["response_text"], data["reward"])}
    assert set(data["response_text"]) == {"2"}
    scores = sorted(data["reward"])
    assert scores == [0.0, 0.0, 1.0], rewards


def _journaled_worker(tiny_model_dir, prompt_file, tmp_path):
    cfg = RelaxConfig.model_validate(
        {
            "model": {"hf_checkpoint": tiny_model_dir},
            "data": {"prompt_data": prompt_file},
            "rollout": {"rollout_batch_size": 1, "n_samples_per_prompt": 2, "rollout_max_response_len": 3},
            "run": {"mode": "fully_async", "output_dir": str(tmp_path)},
        }
    )
    return RolloutWorker(cfg, DataBus(bus_config(cfg)), tiny_model_dir, prompt_file, torch_threads=1)


def test_a_rollout_restarted_between_two_steps_draws_the_next_prompts(tiny_model_dir, prompt_file, tmp_path):
    """Killed after step 1 landed and before step 2 began: the new process goes on at step 2 with the
    prompts step 2 would have had (not from the start of the data)."""
    first = _journaled_worker(tiny_model_dir, prompt_file, tmp_path)
    first.reset_journal()
    for step in range(3):
        first.produce(step)
    expected = [p for _, p in first.get_record().prompt_log]
    first.reset_journal()
    dead = _journaled_worker(tiny_model_dir, prompt_file, tmp_path)
    for step in range(2):
        dead.produce(step)
    new = _journaled_worker(tiny_model_dir, prompt_file, tmp_path)  # (dead's process is gone)
    assert new.recover() == 2
    new.produce(2)
    assert [p for _, p in new.get_record().prompt_log] == expected


def test_recover_without_the_data_position_refuses(tiny_model_dir, prompt_file, tmp_path):
    worker = _journaled_worker(tiny_model_dir, prompt_file, tmp_path)
    worker.journal.path.write_text(json.dumps({"put": 0, "prompts": ["r0"]}) + "\n")  # an old journal
    with pytest.raises(RuntimeError, match="no data position for step 1"):
        worker.recover()


def test_a_reward_that_kills_its_process_is_a_counted_failure_with_process_isolation(
    tiny_model_dir, prompt_file, tmp_path, monkeypatch
):
    """User reward code calling ``os._exit`` ended the rollout worker (and the run) with no message: rewards
    only ran in threads, and no flag reached relax-rewards' process isolation."""
    (tmp_path / "exiting_reward.py").write_text(
        "import os\n\ndef reward(response, label, metadata=None):\n    os._exit(3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, bus, worker = make_worker(
        tiny_model_dir,
        prompt_file,
        rm_type="exiting_reward:reward",
        reward_isolation="process",
        reward_timeout_s=30,
    )
    try:
        worker.produce(step=0)
    finally:
        worker.close()
    data = bus.get("advantages", cfg.samples_per_rollout, timeout=5).data
    assert set(data["reward"]) == {0.0}
    assert all(f.startswith("worker process died") or "exit" in f for f in data["reward_failure"]), data[
        "reward_failure"
    ][:2]
    assert worker.get_record().stats["reward"]["crashed"] == cfg.samples_per_rollout


def test_a_prompt_past_the_context_is_skipped_and_counted_not_generated(tiny_model_dir, tmp_path):
    """A 100k-character prompt reached the engine and was OOM-killed without a message."""
    rows = [{"prompt": "1+1=", "label": "2"}, {"prompt": "1+" * 400 + "1=", "label": "401"}]
    path = tmp_path / "long.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg, bus, worker = make_worker(tiny_model_dir, str(path), rollout_batch_size=2, n_samples_per_prompt=1)
    assert worker.prompts.context_len == 128
    worker.produce(step=0)
    data = bus.get("advantages", 2, timeout=5).data
    assert all(len(t) < 128 for t in data["tokens"])  # only the short prompt, drawn twice
    stats = worker.get_record().stats
    assert stats["long_prompt_rows"] >= 1
    assert any("exceed the model's context of 128 tokens" in m for m in stats["skipped_examples"])
