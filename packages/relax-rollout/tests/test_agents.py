"""--agent-path: the user's agent, unmodified (real ``anthropic`` / ``openai`` SDKs), talks to the rollout's own
engine server; what it produced under its sessions is what the rollout puts on the bus (``relax_rollout.agents``).

A real RolloutWorker on the tiny checkpoint, an in-process bus; the agents are ``relax_testing.agents``."""

import json

import numpy as np
import pytest

pytest.importorskip("anthropic")
pytest.importorskip("openai")

from relax_bus import DataBus  # noqa: E402
from relax_core import sample  # noqa: E402
from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.controller import bus_config  # noqa: E402
from relax_rollout.worker import RolloutWorker  # noqa: E402
from relax_testing import agents  # noqa: E402

ROWS = [("1+1=", "2"), ("12+3=", "15"), ("4+4=", "8"), ("4+5=", "9"), ("3+4=", "7")]


@pytest.fixture(autouse=True)
def _seen():
    """Each test's own record of what its agents saw (session names repeat across tests)."""
    agents.SEEN.clear()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "label": lab}) + "\n" for p, lab in ROWS))
    return str(path)


def _worker(model, prompts, agent, **over):
    r = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "rollout_max_response_len": 4, "rm_type": "math"}
    a = {"agent_path": f"relax_testing.agents:{agent}"}
    for k, v in over.items():
        (a if k.startswith("agent") else r)[k] = v
    cfg = RelaxConfig.model_validate(
        {"model": {"hf_checkpoint": model}, "data": {"prompt_data": prompts}, "rollout": r, "agent": a}
    )
    bus = DataBus(bus_config(cfg))
    return cfg, bus, RolloutWorker(cfg, bus, model, prompts, torch_threads=1)


def _label(worker, d, i) -> str:
    """The label of sample ``i``'s row (the data iterator shuffles: found by the prompt's text)."""
    prompt = worker.tokenizer.decode(d[sample.TOKENS][i][: d[sample.PROMPT_LEN][i]].tolist())
    (label,) = [lab for p, lab in ROWS if f"user{p}" in prompt.replace("<|endoftext|>", "")]
    return label


def _label_index(worker, d, label: str) -> int:
    return [_label(worker, d, i) for i in range(len(d[sample.TOKENS]))].index(label)


def _trained_text(worker, d, i) -> str:
    """What sample ``i``'s loss mask covers, decoded."""
    resp = np.asarray(d[sample.TOKENS][i][d[sample.PROMPT_LEN][i] :])
    on = resp[np.asarray(d[sample.LOSS_MASK][i]) > 0]
    return worker.tokenizer.decode(on.tolist(), skip_special_tokens=True)


def test_a_messages_agent_s_turns_are_its_samples_token_exact(tiny_model_dir, prompt_file):
    """Two turns through the anthropic SDK: each sample is one episode, its loss mask covers exactly the
    replies the agent got, the log-probs are the trainer's at --rollout-temperature (the agent asked 0.3)."""
    from relax_train.backends.torch_backend import TorchBackend

    cfg, bus, worker = _worker(tiny_model_dir, prompt_file, "messages_two_turns")
    try:
        worker.produce(0)
    finally:
        worker.close()
    d = bus.get("advantages", cfg.samples_per_rollout, timeout=5).data
    assert len(d[sample.TOKENS]) == 4 and set(d[sample.AGENT]) == {"agent"}
    assert [g for g in d[sample.GROUP_ID]] == ["0:0", "0:0", "0:1", "0:1"]
    for i in range(4):
        session = f"0:{i // 2}:{i % 2}/agent"
        assert _trained_text(worker, d, i) == "".join(agents.SEEN[session])
        assert (
            d[sample.TURNS][i] == len(agents.SEEN[session]) and len(d[sample.TURN_S][i]) == d[sample.TURNS][i]
        )
        assert d[sample.REWARD][i] == float(agents.SEEN[session][-1].strip() == _label(worker, d, i))
    lp = TorchBackend(cfg, tiny_model_dir, trainable=False).compute_log_probs(d)
    for mine, theirs, mask in zip(d[sample.ROLLOUT_LOG_PROBS], lp, d[sample.LOSS_MASK]):
        on = np.asarray(mask) > 0
        np.testing.assert_allclose(np.asarray(mine)[on], np.asarray(theirs)[on], atol=1e-4, rtol=0)


def test_two_agents_each_train_on_their_own_tokens(tiny_model_dir, prompt_file):
    """A solver (Chat Completions) and a checker (Messages) in one episode: a sample per agent, grouped per
    agent, each one's mask covering only its own replies (the solver's answer is in the checker's prompt,
    never in its mask), each rewarded by the dict the agent returned."""
    cfg, bus, worker = _worker(
        tiny_model_dir, prompt_file, "solver_and_checker", agents=["solver", "checker"]
    )
    try:
        worker.produce(0)
    finally:
        worker.close()
    assert cfg.samples_per_rollout == 8
    d = bus.get("advantages", 8, timeout=5).data
    assert d[sample.AGENT] == ["solver", "solver", "checker", "checker"] * 2
    assert len(set(d[sample.GROUP_ID])) == 4  # (row, agent): each agent's n samples of a prompt
    for i, agent in enumerate(d[sample.AGENT]):
        g, j = divmod(i, 4)
        session = f"0:{g}:{j % 2}/{agent}"
        assert _trained_text(worker, d, i) == agents.SEEN[session][-1]
        assert d[sample.REWARD][i] == float(agents.SEEN[session][-1].strip() == _label(worker, d, i))
        if agent == "checker":
            solver_said = agents.SEEN[f"0:{g}:{j % 2}/solver"][-1].strip()
            prompt = worker.tokenizer.decode(d[sample.TOKENS][i][: d[sample.PROMPT_LEN][i]].tolist())
            assert f"={solver_said}" in prompt.replace(
                "<|endoftext|>", ""
            )  # (the tiny vocabulary has no "?")


def test_an_agent_that_fails_ends_its_own_episode_counted(tiny_model_dir, prompt_file):
    """Raises, hangs past --agent-timeout-s (its later call refused), returns a string, makes no call: each
    episode's sample is there with the failure score and counted; the others' are untouched."""
    import time

    cfg, bus, worker = _worker(
        tiny_model_dir,
        prompt_file,
        "misbehaving",
        rollout_batch_size=5,
        n_samples_per_prompt=1,
        agent_timeout_s=1.5,
    )
    try:
        worker.produce(0)
        d = bus.get("advantages", 5, timeout=5).data
        deadline = time.monotonic() + 10
        hung = f"0:{_label_index(worker, d, '15')}:0/agent"
        while hung not in agents.SEEN and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        worker.close()
    labels = [_label(worker, d, i) for i in range(5)]
    stops = dict(zip(labels, d[sample.FINISH_REASON]))
    assert stops.pop("7") in ("agent_done", "length")  # ("length": its last reply was cut at max_tokens)
    assert stops == {"2": "agent_error", "15": "agent_timeout", "8": "bad_return", "9": "no_calls"}
    failures = dict(zip(labels, d[sample.REWARD_FAILURE]))
    assert "RuntimeError: the agent's tool crashed" in failures["2"] and "--agent-timeout-s" in failures["15"]
    assert (
        "bad return" in failures["8"] and failures["7"] == "" and d[sample.REWARD][labels.index("7")] == 1.0
    )
    none = labels.index("9")  # no call: a sample with nothing to train on
    assert d[sample.RESPONSE_LEN][none] == 1 and float(np.sum(d[sample.LOSS_MASK][none])) == 0.0
    assert float(np.sum(d[sample.LOSS_MASK][labels.index("2")])) > 0  # the crashed agent's call is kept
    counts = worker.get_record().stats["reward"]
    assert counts["agent_error"] == counts["agent_timeout"] == counts["bad_return"] == counts["no_calls"] == 1
    assert agents.SEEN[hung] == ["refused: 400"]  # the timed-out episode's later call


def test_an_async_agent_runs(tiny_model_dir, prompt_file):
    cfg, bus, worker = _worker(tiny_model_dir, prompt_file, "async_agent", n_samples_per_prompt=1)
    try:
        worker.produce(0)
    finally:
        worker.close()
    d = bus.get("advantages", 2, timeout=5).data
    assert d[sample.REWARD] == [0.5, 0.5] and set(d[sample.FINISH_REASON]) <= {"agent_done", "length"}
    assert [len(v) for v in agents.SEEN.values()] == [1, 1]
    assert d[sample.TOOL_CALL_ERRORS] == [1, 1]  # (task.tool_failed())


def test_the_time_out_counts_from_an_episode_s_start_not_its_wait_for_a_thread(tiny_model_dir, prompt_file):
    """One thread (--agent-concurrency 1), four episodes of 0.6 s each, --agent-timeout-s 1.5: the last one
    starts 1.8 s after the batch did, and still has its 1.5 s (it timed out, waiting, before)."""
    cfg, bus, worker = _worker(tiny_model_dir, prompt_file, "slow", agent_concurrency=1, agent_timeout_s=1.5)
    try:
        worker.produce(0)
    finally:
        worker.close()
    d = bus.get("advantages", 4, timeout=5).data
    assert d[sample.REWARD] == [1.0] * 4 and "agent_timeout" not in d[sample.FINISH_REASON]
