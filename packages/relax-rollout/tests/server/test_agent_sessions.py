"""Agent sessions with scripted replies (deterministic, canonical tokens): the spliced trajectory equals the
chat template's rendering, awkward replies (empty, a piece of the end-of-turn marker, cut by max_tokens)
splice correctly, concurrent sessions stay apart, context overflow closes with ``length``, trajectory
endpoints follow the token rule, and ``examples/external_agent.py`` runs a recorded, trainable loop."""

import importlib.util
import math
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
TorchBackend = pytest.importorskip("relax_train.backends.torch_backend").TorchBackend

from relax_rollout.server.trajectories import to_bus_sample  # noqa: E402

pytestmark = pytest.mark.integration
EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "external_agent.py"


@pytest.fixture(scope="module")
def tok(chat_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(chat_model_dir)


def ask(url: str, session: str, messages: list[dict], *new: dict, max_tokens: int = 32) -> list[dict]:
    """One step of an agent: send the conversation plus ``new`` messages, append the reply verbatim."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    messages = [*messages, *new]
    r = client.chat.completions.create(
        model="m", messages=messages, max_tokens=max_tokens, extra_headers={"X-Relax-Session": session}
    )
    return [*messages, {"role": "assistant", "content": r.choices[0].message.content}]


def test_awkward_replies_splice_and_equal_the_template_rendering(
    chat_model_dir, tok, serve, scripted, call, backend_cfg
):
    # an empty reply and "d" (inside "<|im_end|>") defeat a search for the reply's text; "123456789" is cut
    # at max_tokens=8 (no end-of-turn token: the template's suffix supplies it, outside the loss mask)
    replies = ["calc: 17+25", "", "d", "123456789", "The answer is 84."]
    url = serve(scripted(chat_model_dir, replies), tok)
    messages = ask(
        url,
        "a1",
        [],
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 17+25?"},
    )
    messages = ask(url, "a1", messages, {"role": "tool", "content": "42"})
    messages = ask(url, "a1", messages, {"role": "user", "content": "Go on"})
    messages = ask(url, "a1", messages, {"role": "user", "content": "Count"}, max_tokens=8)
    messages = ask(url, "a1", messages, {"role": "user", "content": "Answer"})
    code, traj = call(url, "/relax/trajectories/a1")
    assert code == 200 and traj["num_calls"] == 5 and traj["index"] == 0
    assert traj["finish_reasons"] == ["stop", "stop", "stop", "length", "stop"]
    text = tok.apply_chat_template(messages, tokenize=False).removesuffix("\n")  # ends with our EOS
    assert traj["tokens"] == tok.encode(text, add_special_tokens=False)
    # loss mask: 1 exactly on the model's tokens (the scripted replies + EOS, the cut one without)
    want = [tok.encode(r, add_special_tokens=False) + [tok.eos_token_id] for r in replies]
    want[3] = want[3][:8]
    got = [traj["tokens"][a:b] for a, b in traj["completion_spans"]]
    assert got == want and sum(traj["loss_mask"]) == sum(map(len, want))
    mask = np.asarray(traj["loss_mask"], dtype=bool)
    body = np.asarray(traj["tokens"][traj["prompt_len"] :])
    assert np.array_equal(body[mask], np.concatenate([np.asarray(w) for w in want]))
    # the recorded log-probs line up with the trainer's, position by position
    lp = TorchBackend(backend_cfg, chat_model_dir, trainable=False).compute_log_probs(
        {"tokens": [np.asarray(traj["tokens"])], "prompt_len": [traj["prompt_len"]]}
    )[0]
    assert np.abs(lp[mask] - np.asarray(traj["rollout_log_probs"])[mask]).max() < 1e-4
    assert not np.asarray(traj["rollout_log_probs"])[~mask].any()


def test_concurrent_sessions_stay_apart(chat_model_dir, tok, serve, scripted, call):
    url = serve(scripted(chat_model_dir), tok)  # every reply is "ok"
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            msgs = ask(url, f"c{i}", [], {"role": "user", "content": f"{i}+{i}"})
            ask(url, f"c{i}", msgs, {"role": "user", "content": "again"})
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    for i in range(6):
        traj = call(url, f"/relax/trajectories/c{i}")[1]
        assert traj["num_calls"] == 2 and traj["stop_reason"] is None
        assert traj["messages"][0]["content"] == f"{i}+{i}"


def test_context_overflow_closes_with_length(chat_model_dir, tok, serve, scripted, call):
    url = serve(scripted(chat_model_dir, ["abc " * 10]), tok, max_context=60)
    messages = ask(url, "long", [], {"role": "user", "content": "hi"})
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(
            model="m",
            messages=[*messages, {"role": "user", "content": "more " * 5}],
            extra_headers={"X-Relax-Session": "long"},
        )
    traj = call(url, "/relax/trajectories/long")[1]
    assert traj["stop_reason"] == "length" and traj["num_calls"] == 1
    assert to_bus_sample(traj, 0.0, "g")["finish_reason"] == "length"


def test_trajectory_endpoints_need_the_token_when_the_server_has_one(
    chat_model_dir, tok, serve, scripted, call
):
    url = serve(scripted(chat_model_dir), tok, token="s3cret")
    ask(url, "t1", [], {"role": "user", "content": "hi"})  # chat stays open, as generation does
    for path, body in [
        ("/relax/trajectories", None),
        ("/relax/trajectories/t1", None),
        ("/relax/trajectories/t1/close", {"reward": 1}),
    ]:
        assert call(url, path, body)[0] == 401
        assert call(url, path, body, token="s3cret")[0] == 200, path


def test_to_bus_sample_needs_a_reward():
    traj = {
        "session": "x",
        "index": 0,
        "tokens": [5, 6, 7],
        "prompt_len": 2,
        "loss_mask": [1],
        "rollout_log_probs": [-0.5],
        "finish_reasons": ["stop"],
        "weight_versions": [3],
        "reward": None,
    }
    with pytest.raises(ValueError, match="reward"):
        to_bus_sample(traj, None, "g")
    s = to_bus_sample(traj, 1, "g")
    assert s["policy_version"] == 3 and s["response_len"] == 1 and s["tokens"].dtype == np.int64
    with pytest.raises(ValueError, match="inconsistent"):
        to_bus_sample({**traj, "loss_mask": [1, 0]}, 1, "g")


def load_example():
    spec = importlib.util.spec_from_file_location("external_agent", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_example_calc_is_safe():
    calc = load_example().calc
    assert calc(" -3*2+1 ") == -5 and calc("7/2") == 3.5
    for bad in ["2**3", "__import__('os')", "(1).real", "x+1", "[1]"]:
        with pytest.raises(ValueError):
            calc(bad)
    with pytest.raises(ZeroDivisionError):
        calc("1/0")


def test_example_agent_is_recorded_and_trainable(
    chat_model_dir, tok, serve, scripted, call, backend_cfg, capsys
):
    # two runs of the example on one task: one right (uses the calculator), one wrong
    url = serve(scripted(chat_model_dir, ["calc: 12*7", "It is 84.", "It is 85."]), tok)
    ex = load_example()
    right = ex.main(["--base-url", f"{url}/v1", "--session", "calc/1", "--question", "12*7"])
    wrong = ex.main(["--base-url", f"{url}/v1", "--session", "calc/2", "--question", "12*7"])
    assert '"reward": 1.0' in capsys.readouterr().out
    assert right["reward"] == 1.0 and right["num_calls"] == 2 and right["stop_reason"] == "closed_by_client"
    assert wrong["reward"] == 0.0 and wrong["num_calls"] == 1
    trajs = [call(url, f"/relax/trajectories/calc%2F{i}")[1] for i in (1, 2)]
    assert trajs[0]["messages"][3] == {"role": "user", "content": "result: 84"}
    samples = [to_bus_sample(t, None, "12*7") for t in trajs]
    from relax_train.algorithms import compute_advantages

    batch = {k: [s[k] for s in samples] for k in samples[0]}
    batch["advantages"] = compute_advantages(
        "grpo", batch["group_id"], batch["reward"], batch["response_len"]
    )
    assert batch["advantages"][0][0] > 0 > batch["advantages"][1][0]
    metrics = TorchBackend(backend_cfg, chat_model_dir, trainable=True).train_step(batch)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0


def test_recorder_bounds_closed_trajectories_and_survives_a_history_editing_template(tok):
    import copy

    from relax_rollout.engines.base import GenerateOutput
    from relax_rollout.server.protocol import NotFound
    from relax_rollout.server.trajectories import TrajectoryRecorder

    ids = tok.encode("ok", add_special_tokens=False) + [tok.eos_token_id]
    out = GenerateOutput(ids, [-1.0] * len(ids), "stop", 0)
    first = [{"role": "user", "content": "hi"}]
    rec = TrajectoryRecorder(tok, keep_closed=1)
    for name in ("a", "b"):
        with rec.turn(name, first) as t:
            t.record(out, "ok")
        rec.close(name, 0.5)
    with pytest.raises(NotFound, match="dropped"):
        rec.get("a")  # the oldest closed one was dropped
    assert rec.get("b")["reward"] == 0.5 and [s["session"] for s in rec.sessions()] == ["b"]

    editing = copy.deepcopy(tok)  # renders the message count first: earlier text changes every turn
    editing.chat_template = "{{ messages|length }}" + tok.chat_template
    rec = TrajectoryRecorder(editing)
    for messages in (
        first,
        [*first, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}],
    ):
        with rec.turn("e", messages) as t:
            t.record(out, "ok")
    assert rec.get("e", 0)["stop_reason"] == "template_not_append_only" and rec.get("e")["index"] == 1
