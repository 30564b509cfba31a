"""Run notifications through Apprise, delivered to a JSON webhook served by the test itself."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from relax_app.cli_config import ConfigError, build_config
from relax_core.controller import Controller, RunInputs, RunResult
from relax_core.notify import Notifier, summary_figures
from relax_testing import dead_json_url, json_webhook

pytest.importorskip("apprise")


@pytest.fixture
def hook():
    with json_webhook() as (url, received):
        yield url, received


_dead_url = dead_json_url


def _result(**kw) -> RunResult:
    history = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "rollout/reward_mean": 0.25, "train/loss": 0.5},
        {"step": 2, "rollout/reward_mean": 0.75, "train/loss": 0.4},
        {"step": 2, "eval/accuracy": 0.5},
    ]
    return RunResult(
        history, wall_s=12.34, rl_wall_s=10.0, samples=32, mode="colocate", max_staleness=0, **kw
    )


def test_start_finish_failure_restart_reach_the_endpoint(hook):
    url, received = hook
    n = Notifier([url + "/hook"], run_name="exp1")
    assert n.enabled
    assert n.start({"mode": "colocate", "steps": 2})
    assert n.finish(_result(trace_path="/x/trace.json"))
    assert n.failure(RuntimeError("CUDA out of memory"))
    assert n.restart(2, "from step_000010")
    assert [p for p, _ in received] == ["/hook"] * 4
    (_, start), (_, finish), (_, failure), (_, restart) = received
    assert start["title"] == "Relax run exp1 started" and start["type"] == "info"
    assert "mode: colocate" in start["message"] and "steps: 2" in start["message"]
    assert finish["title"] == "Relax run exp1 finished" and finish["type"] == "success"
    for line in (
        "steps: 2",
        "samples: 32",
        "wall_s: 12.3",
        "final_reward: 0.75",
        "final_eval_accuracy: 0.5",
        "trace: /x/trace.json",
    ):
        assert line in finish["message"].splitlines()
    assert failure["title"] == "Relax run exp1 failed" and failure["type"] == "failure"
    assert failure["message"].startswith("RuntimeError: CUDA out of memory\n")
    assert restart["title"] == "Relax run exp1 restarted" and restart["type"] == "warning"
    assert "attempt 2: from step_000010" in restart["message"]


def test_summary_figures_without_eval():
    figures = summary_figures(RunResult([], 1.0, 0.5, 0, "fully_async", 1))
    assert (
        figures["steps"] == 0 and figures["final_reward"] is None and figures["final_eval_accuracy"] is None
    )


def test_no_urls_does_nothing_and_never_imports_apprise():
    code = (
        "import sys\n"
        "from relax_core.notify import Notifier\n"
        "n = Notifier([])\n"
        "assert not n.enabled and n.start({}) is False and n.failure(ValueError()) is False\n"
        "assert 'apprise' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_unreachable_url_warns_and_does_not_raise(hook, caplog):
    url, received = hook
    n = Notifier([_dead_url(), url + "/ok"])
    with caplog.at_level(logging.WARNING, logger="relax_core.notify"):
        assert n.start({"mode": "colocate"}) is False  # not every service got it...
    assert [p for p, _ in received] == ["/ok"]  # ...but the live one did
    assert "not delivered" in caplog.text


def test_an_exception_inside_apprise_is_only_a_warning(caplog, monkeypatch):
    n = Notifier([_dead_url()])

    def boom(**kw):
        raise OSError("network is down")

    monkeypatch.setattr(n._apprise, "notify", boom)
    with caplog.at_level(logging.WARNING, logger="relax_core.notify"):
        assert n.finish(_result()) is False
    assert "OSError: network is down" in caplog.text


def test_a_url_apprise_cannot_read_fails_before_the_run_without_leaking_it():
    with pytest.raises(ValueError, match=r"entry 2 \(notaservice://\.\.\.\)") as e:
        Notifier(["json://127.0.0.1:1/x", "notaservice://secret-token@host"])
    assert "secret-token" not in str(e.value)


def test_flags_parse():
    cfg = build_config(None, ["--notify-urls", '["json://127.0.0.1:8000/hook", "ntfy://topic"]'])
    assert cfg.run.notify_urls == ["json://127.0.0.1:8000/hook", "ntfy://topic"]
    assert build_config(None, ["--notify-urls", "json://127.0.0.1:8000/hook"]).run.notify_urls == [
        "json://127.0.0.1:8000/hook"
    ]
    default = build_config(None, [])
    assert default.run.notify_urls == [] and default.run.trace is True
    assert build_config(None, ["--no-trace"]).run.trace is False
    with pytest.raises(ConfigError, match="--notify-urls"):
        build_config(None, ["--notify-urls", "{a: 1}"])


def test_controller_run_notifies_start_and_finish(hook, monkeypatch, tmp_path):
    url, received = hook
    cfg = build_config(None, ["--notify-urls", url + "/run", "--output-dir", str(tmp_path / "exp2")])
    monkeypatch.setattr("relax_core.controller.run_colocate", lambda *a: _result())
    result = Controller(cfg, RunInputs("m", "p")).run()
    assert result.samples == 32
    titles = [b["title"] for _, b in received]
    assert titles == ["Relax run exp2 started", "Relax run exp2 finished"]


def test_controller_run_failure_is_notified_and_reraised(hook, monkeypatch, tmp_path):
    url, received = hook
    cfg = build_config(None, ["--notify-urls", url, "--output-dir", str(tmp_path / "exp3")])
    error = RuntimeError("trainer diverged: loss is nan")

    def fail(*args):
        raise error

    monkeypatch.setattr("relax_core.controller.run_colocate", fail)
    with pytest.raises(RuntimeError) as e:
        Controller(cfg, RunInputs("m", "p")).run()
    assert e.value is error
    titles = [b["title"] for _, b in received]
    assert titles == ["Relax run exp3 started", "Relax run exp3 failed"]
    assert received[1][1]["message"].startswith("RuntimeError: trainer diverged: loss is nan")


def test_controller_run_with_only_dead_urls_still_succeeds(monkeypatch, tmp_path):
    cfg = build_config(None, ["--notify-urls", json.dumps([_dead_url()]), "--output-dir", str(tmp_path)])
    monkeypatch.setattr("relax_core.controller.run_colocate", lambda *a: _result())
    assert Controller(cfg, RunInputs("m", "p")).run().samples == 32
