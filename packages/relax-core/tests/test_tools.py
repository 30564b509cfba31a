import time

from relax_core.env import check_environment
from relax_core.tools import ToolEnv


class Weather(ToolEnv):
    timeout_s = 0.3
    max_calls = 3
    tools = {
        "weather": lambda city: f"sunny in {city}",
        "slow": lambda: time.sleep(2),
        "broken": lambda: 1 / 0,
    }

    def score(self, answer):
        return 1.0 if "sunny" in answer else 0.0


def call(name, **args):
    import json

    return f"thinking... <tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_a_tool_call_returns_the_result_as_a_tool_message_and_an_answer_ends():
    t = check_environment(Weather, responses=(call("weather", city="Oslo"), "it is sunny"))
    (_, obs, done, info), (_, _, end, final) = t
    assert obs == {"name": "weather", "content": "sunny in Oslo"} and not done and info["tool_calls"] == 1
    assert end and final["reward"] == 1.0
    assert Weather("p", "l").format_observation(obs) == [{"role": "tool", "content": "sunny in Oslo"}]


def test_tool_failures_become_observations_the_model_can_read():
    env = Weather("p", "l")
    cases = {
        call("nope"): "unknown tool 'nope'",
        call("weather", town="x"): "bad arguments for weather",
        call("broken"): "broken failed: ZeroDivisionError",
        "<tool_call>{not json}</tool_call>": "malformed tool call",
    }
    for response, expect in cases.items():
        obs, done, info = env.step(response)
        assert expect in obs["content"] and obs["content"].startswith("error:")
    assert (info["tool_calls"], info["tool_errors"]) == (4, 4)  # (counted for the run's error rate)
    _, _, info = env.step(call("weather", city="x"))
    assert (info["tool_calls"], info["tool_errors"]) == (5, 4)
    env.close()


def test_a_stuck_tool_times_out_and_too_many_calls_end_the_episode():
    env = Weather("p", "l")
    t0 = time.monotonic()
    obs, done, _ = env.step(call("slow"))
    assert "timed out after 0.3s" in obs["content"] and time.monotonic() - t0 < 1.5 and not done
    assert (
        env.step(call("weather", city="a"))[0]["content"] == "sunny in a"
    )  # a fresh worker after the time-out
    obs, done, info = env.step(call("weather", city="b"))
    assert done and info["reward"] == 0.0 and info["tool_calls"] == 3
    env.close()
