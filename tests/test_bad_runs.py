"""A hostile but fair run, end to end as a user starts it (`relax train`, both modes; fully async on a real
local Ray cluster): a dataset with a malformed row, a prompt past the model's context, a media marker in a
text run and unlabeled rows, scored by a reward that returns inf, NaN, 10**400 or a value whose ``__float__``
blocks, raises, hangs or ends its own process (``relax_testing.hostile_reward``, under process isolation
and under the default thread isolation, where ``os._exit`` used to end the run without a word and 10**400 to
kill it with an OverflowError). The run finishes;
each bad thing is skipped or scored the fallback, counted in summary.json and said in one console line per
reason; no traceback; the loss stays finite (a reward of inf or NaN cannot reach the weights)."""

from __future__ import annotations

import json
import math

import pytest

from relax_app.cli import main
from relax_testing import build_tiny_checkpoint

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

LABELS = ["2", "inf", "nan", "huge", "raise", "hang", "blocking", "exit", None, "4"]
"""One prompt per label (``hostile_reward``'s behaviours, an unlabeled row, two ordinary ones)."""
FAILURES = {"bad_return", "raised:ValueError", "timeout", "crashed"}
"""The reward failures the labels cause (inf, NaN and 10**400 are a bad return; a blocking float a time-out)."""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("model"))


def _dataset(path):
    rows = [{"prompt": f"{i}+1=", "label": label} for i, label in enumerate(LABELS)]
    rows.append({"prompt": "<image>2+2=", "label": "4"})  # a media marker, no media column
    rows.append({"prompt": "1+" * 100 + "1=", "label": "101"})  # 202 tokens: past the 128-token context
    lines = [json.dumps(r) for r in rows]
    lines.insert(3, "not json")  # a malformed row
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(
    "mode, isolation", [("colocate", "process"), ("fully_async", "process"), ("colocate", "thread")]
)
def test_a_hostile_run_finishes_counts_and_says_every_bad_thing(model, tmp_path, capfd, mode, isolation):
    out = tmp_path / "out"
    argv = ["train", "--prompt-data", str(_dataset(tmp_path / "data.jsonl")), "--hf-checkpoint", model]
    argv += ["--rm-type", "relax_testing:hostile_reward", "--reward-isolation", isolation]
    argv += ["--reward-timeout-s", "3", "--rollout-batch-size", "5", "--n-samples-per-prompt", "2"]
    argv += ["--rollout-max-response-len", "4", "--num-rollout", "3", "--micro-batch-size", "10"]
    argv += ["--torch-threads", "1", "--no-progress", "--output-dir", str(out)]
    argv += ["--fully-async", "--max-staleness", "1"] if mode == "fully_async" else []
    assert main(argv) == 0
    console = capfd.readouterr()
    assert "Traceback" not in console.out + console.err
    assert "prompts mark media" in console.err  # said before the run: they train as text

    summary = json.loads((out / "summary.json").read_text())
    failures = summary["reward_failures"]
    assert set(failures) == FAILURES and all(n >= 2 for n in failures.values()), failures
    assert summary["reward_unlabeled"] >= 2 and summary["skipped_rows"] == 1
    assert summary["long_prompt_rows"] >= 1 and summary["samples_trained"] == 30
    said = [line for line in console.out.splitlines() if line.startswith("[relax] ")]
    for reason in FAILURES:
        assert any(f"rewards failed ({reason})" in line for line in said), (reason, said)
    for words in ("dataset rows skipped", "longer than the model's context", "scored without a label"):
        assert sum(words in line for line in said) == 1, (words, said)

    losses = [r["train/loss"] for r in map(json.loads, (out / "metrics.jsonl").open()) if "train/loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses


CRASH = ["--rm-type", "relax_testing:crashing_reward", "--num-rollout", "2", "--torch-threads", "1"]
CRASH += ["--rollout-max-response-len", "8"]  # (the tiny model holds 128 positions; the default is 512)


@pytest.mark.integration
def test_a_reward_that_crashes_its_process_is_named(model, tmp_path):
    """Thread isolation cannot survive a segfault; what it can do is say which reward did it (before: the
    run ended with no message, or fully async failed after 129 s naming no reward). Fully async: the health
    manager's reason names the reward and --reward-isolation process. Colocate: the run's own process dies;
    the next run in the directory says so."""
    import subprocess
    import sys

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))
    base = [
        sys.executable,
        "-m",
        "relax_app.cli",
        "train",
        "--prompt-data",
        str(data),
        "--hf-checkpoint",
        model,
    ]
    base += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--no-progress", *CRASH]
    out = tmp_path / "async"
    flags = [
        "--fully-async",
        "--max-staleness",
        "1",
        "--max-restarts-per-role",
        "0",
        "--max-global-restarts",
        "0",
    ]
    run = subprocess.run(
        [*base, *flags, "--output-dir", str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 1, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("relax: the run stopped: role 'rollout' failed (") and "\n" not in last
    assert "while the reward 'relax_testing:crashing_reward' was running in thread isolation" in last
    assert "--reward-isolation process" in last
    # said before the run, from the pre-flight call (in a process of its own)
    assert "on an empty response to the first row" in run.stderr and "killed by signal 11" in run.stderr
    assert (
        "on an empty response to the first row" in run.stderr
        and "reward process died (killed by signal 11)" in (run.stderr)
    )  # (said before the run, from the pre-flight call in a process of its own)

    out = tmp_path / "colocate"
    died = subprocess.run([*base, "--output-dir", str(out)], capture_output=True, text=True, timeout=600)
    assert died.returncode == -11  # SIGSEGV: nothing in the process can say anything
    again = subprocess.run([*base, "--output-dir", str(out)], capture_output=True, text=True, timeout=600)
    said = again.stdout + again.stderr
    assert f"[relax] WARNING: the previous run in {out} ended without a word: its process (pid " in said
    assert "died while the reward 'relax_testing:crashing_reward' was running in thread isolation" in said
