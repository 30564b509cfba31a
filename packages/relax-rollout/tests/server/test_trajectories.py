"""Agents outside the engine: a scripted agent on the real ``openai`` client, served by the torch engine, is
recorded token in / token out — the trajectory is exactly the per-call prompt and completion ids, its loss
mask is 1 on the sampled tokens only, its log-probs are the trainer's, and it trains through the bus shape."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
TorchBackend = pytest.importorskip("relax_train.backends.torch_backend").TorchBackend

from relax_rollout.engines.torch_engine import TorchEngine  # noqa: E402
from relax_rollout.server.trajectories import render_prompt, to_bus_sample  # noqa: E402

pytestmark = pytest.mark.integration
MAX_TOKENS = 24
# What the agent sends after each model reply: the question, a tool result, a follow-up.
SCRIPT = [("user", "What is 17+25? Use the calculator."), ("tool", "42"), ("user", "Now double it.")]
WORKER_KEYS = {
    "tokens",
    "prompt_len",
    "response_len",
    "loss_mask",
    "rollout_log_probs",
    "reward",
    "reward_failure",
    "policy_version",
    "group_id",
    "prompt_id",
    "rollout_step",
    "finish_reason",
    "response_text",
}


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


@pytest.fixture(scope="module")
def url(chat_model_dir, tok, serve):
    engine = TorchEngine(
        model_path=chat_model_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    return serve(engine, tok)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def chat(client, messages, **kw) -> dict:
    r = client.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=1.0, logprobs=True, **kw
    )
    c = r.choices[0]
    return {
        "content": c.message.content,
        "finish": c.finish_reason,
        "ids": c.model_extra["token_ids"],
        "prompt": r.model_extra["prompt_token_ids"],
        "logprobs": [x.logprob for x in c.logprobs.content],
        "relax": r.model_extra.get("relax_trajectory"),
    }


def run_agent(client, session_kw: dict, script=SCRIPT) -> tuple[list[dict], list[dict]]:
    """The external agent: sends its message, appends the reply verbatim, sends the next message."""
    messages, calls = [{"role": "system", "content": "You can use a calculator."}], []
    for role, content in script:
        messages.append({"role": role, "content": content})
        calls.append(chat(client, messages, **session_kw))
        messages.append({"role": "assistant", "content": calls[-1]["content"]})
    return calls, messages


def ended(tok, call: dict) -> bool:
    return bool(call["ids"]) and call["ids"][-1] == tok.eos_token_id


def expected_suffix(tok, history: list[dict], new: list[dict], model_ended: bool) -> list[int]:
    """The template text between the reply and the next generation, derived here from the rendering."""
    before = tok.apply_chat_template(history, tokenize=False)
    after = tok.apply_chat_template(history + new, tokenize=False, add_generation_prompt=True)
    eot = tok.eos_token + "\n"
    assert before.endswith(eot) and after.startswith(before)
    text = ("\n" if model_ended else eot) + after[len(before) :]
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def s1(client, url, call):
    calls, messages = run_agent(client, {"extra_headers": {"X-Relax-Session": "s1"}})
    code, traj = call(url, "/relax/trajectories/s1")
    assert code == 200, traj
    return calls, messages, traj


def test_three_turns_are_recorded_token_in_token_out(s1, tok):
    calls, messages, traj = s1
    # each later prompt is the previous prompt + the exact completion + only the template's new suffix
    asst = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for k in range(1, len(calls)):
        prev, cur = calls[k - 1], calls[k]
        history, new = messages[: asst[k - 1] + 1], messages[asst[k - 1] + 1 : asst[k]]
        suffix = expected_suffix(tok, history, new, ended(tok, prev))
        assert cur["prompt"] == prev["prompt"] + prev["ids"] + suffix
    assert calls[0]["prompt"] == render_prompt(tok, messages[:2])
    assert [c["relax"] for c in calls] == [{"session": "s1", "index": 0, "num_calls": k} for k in (1, 2, 3)]

    assert traj["tokens"] == calls[-1]["prompt"] + calls[-1]["ids"]
    assert traj["prompt_len"] == len(calls[0]["prompt"]) and traj["num_calls"] == 3
    assert traj["finish_reasons"] == [c["finish"] for c in calls] and traj["stop_reason"] is None
    n = len(traj["tokens"]) - traj["prompt_len"]
    assert len(traj["loss_mask"]) == len(traj["rollout_log_probs"]) == n
    want_mask, want_logp = [0] * n, [0.0] * n
    for c in calls:
        start = len(c["prompt"]) - traj["prompt_len"]
        want_mask[start : start + len(c["ids"])] = [1] * len(c["ids"])
        want_logp[start : start + len(c["ids"])] = c["logprobs"]
        assert traj["tokens"][len(c["prompt"]) : len(c["prompt"]) + len(c["ids"])] == c["ids"]
    assert traj["loss_mask"] == want_mask and sum(traj["loss_mask"]) == sum(len(c["ids"]) for c in calls)
    assert traj["rollout_log_probs"] == pytest.approx(want_logp, abs=1e-7)
    assert traj["completion_spans"] == [[len(c["prompt"]), len(c["prompt"]) + len(c["ids"])] for c in calls]
    assert traj["messages"] == messages

    # where the sampled tokens are canonical, the trajectory is the template's rendering of the conversation
    body = [c["ids"][:-1] if ended(tok, c) else c["ids"] for c in calls]
    if all(tok.encode(tok.decode(b), add_special_tokens=False) == b for b in body):
        text = tok.apply_chat_template(messages, tokenize=False)
        text = text.removesuffix("\n") if ended(tok, calls[-1]) else text.removesuffix(tok.eos_token + "\n")
        assert traj["tokens"] == tok.encode(text, add_special_tokens=False)


def test_trainer_log_probs_equal_the_recorded_ones(s1, chat_model_dir, backend_cfg):
    traj = s1[2]
    backend = TorchBackend(backend_cfg, chat_model_dir, trainable=False)
    got = backend.compute_log_probs(
        {"tokens": [np.asarray(traj["tokens"], dtype=np.int64)], "prompt_len": [traj["prompt_len"]]}
    )[0]
    mask = np.asarray(traj["loss_mask"], dtype=bool)
    diff = np.abs(got[mask] - np.asarray(traj["rollout_log_probs"], dtype=np.float32)[mask])
    assert mask.sum() > 0 and diff.max() < 1e-4, diff.max()


def test_rewritten_history_starts_a_new_trajectory_and_both_train(
    s1, client, url, call, tok, chat_model_dir, backend_cfg
):
    calls, messages = run_agent(client, {"user": "s2"}, SCRIPT[:2])  # the session named by OpenAI's `user`
    edited = [*messages[:1], {"role": "user", "content": "What is 18+25?"}, *messages[2:4]]
    c = chat(client, edited, user="s2")
    assert c["relax"] == {"session": "s2", "index": 1, "num_calls": 1}
    assert c["prompt"] == render_prompt(tok, edited)  # rendered afresh, not spliced
    code, old = call(url, "/relax/trajectories/s2?index=0")
    assert code == 200 and old["stop_reason"] == "history_rewritten" and old["num_calls"] == 2
    assert old["tokens"] == calls[-1]["prompt"] + calls[-1]["ids"]
    code, new = call(url, "/relax/trajectories/s2")
    assert new["index"] == 1 and new["stop_reason"] is None and new["prompt_len"] == len(c["prompt"])
    sessions = {s["session"]: s for s in call(url, "/relax/trajectories")[1]["data"]}
    assert [t["stop_reason"] for t in sessions["s2"]["trajectories"]] == ["history_rewritten", None]

    code, closed = call(url, "/relax/trajectories/s1/close", {"reward": 1.0})
    assert code == 200 and closed["stop_reason"] == "closed_by_client" and closed["reward"] == 1.0
    samples = [
        to_bus_sample(call(url, "/relax/trajectories/s1")[1], None, "task-0"),
        to_bus_sample(old, 0.0, "task-0"),
    ]
    assert all(set(s) == WORKER_KEYS for s in samples)
    assert samples[0]["response_text"] == s1[1][-1]["content"] and samples[0]["policy_version"] == 0
    from relax_train.algorithms import compute_advantages

    batch = {k: [s[k] for s in samples] for k in WORKER_KEYS}
    batch["advantages"] = compute_advantages(
        "grpo", batch["group_id"], batch["reward"], batch["response_len"]
    )
    backend = TorchBackend(backend_cfg, chat_model_dir, trainable=True)
    metrics = backend.train_step(batch)
    assert math.isfinite(metrics["loss"]) and metrics["optimizer_steps"] == 1.0
    assert metrics["rollout_abs_logp_diff"] < 1e-4  # the trainer saw the masked-in tokens' rollout log-probs


def test_errors_name_what_to_fix(url, call, client):
    code, err = call(url, "/relax/trajectories/nobody")
    assert code == 404 and "nobody" in err["message"] and "X-Relax-Session" in err["message"]
    assert call(url, "/relax/trajectories/nobody/close", {"reward": 1})[0] == 404
    chat(client, [{"role": "user", "content": "1+2="}], extra_headers={"X-Relax-Session": "e1"})
    for body, field in [
        ({"reward": "high"}, "reward"),
        ({"reward": True}, "reward"),
        ({"rewrd": 1}, "rewrd"),
        ([1], "body"),
    ]:
        code, err = call(url, "/relax/trajectories/e1/close", body)
        assert code == 400 and err["param"] == field, err
    assert call(url, "/relax/trajectories/e1?index=x")[1]["param"] == "index"
    assert call(url, "/relax/trajectories/e1?index=5")[0] == 404
    code, err = call(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}], "user": 5})
    assert code == 400 and err["param"] == "user"
    # unrecorded calls (no session) are served as before and leave no trace
    before = call(url, "/relax/trajectories")[1]["data"]
    assert chat(client, [{"role": "user", "content": "1+2="}])["relax"] is None
    assert call(url, "/relax/trajectories")[1]["data"] == before


def test_a_session_taken_for_training_is_closed_returned_and_retired(tok):
    """``take`` (what an --agent-path rollout does once an episode ends): every trajectory of the session, the
    open one closed, each call's latency; the session is forgotten and a later call naming it is refused
    with a 400 naming the header (an agent still running after its episode timed out)."""
    from relax_rollout.engines.base import GenerateOutput
    from relax_rollout.server.protocol import BadRequest
    from relax_rollout.server.trajectories import TrajectoryRecorder

    rec = TrajectoryRecorder(tok)
    first = [{"role": "user", "content": "hi"}]
    for messages in (first, [{"role": "user", "content": "rewritten"}]):  # (the second starts trajectory 1)
        with rec.turn("7:0:1/agent", messages) as t:
            t.record(GenerateOutput([tok.eos_token_id], [-0.1], "stop", 3), "")
    got = rec.take("7:0:1/agent")
    assert [t["index"] for t in got] == [0, 1]
    assert [t["stop_reason"] for t in got] == ["history_rewritten", "closed_by_client"]
    assert got[1]["weight_versions"] == [3] and len(got[1]["call_s"]) == 1 and got[1]["call_s"][0] >= 0
    with pytest.raises(BadRequest, match="has ended") as e:
        rec.turn("7:0:1/agent", first).__enter__()
    assert e.value.field == "X-Relax-Session"
    assert rec.take("never-called") == [] and rec.sessions() == []
