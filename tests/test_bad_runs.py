"""A hostile but fair run, end to end as a user starts it (`relax train`, both modes; fully async on a real
local Ray cluster): a dataset with a malformed row, a prompt past the model's context, a media marker in a
text run and unlabeled rows, scored by a reward that returns inf, NaN, 10**400 or a value whose ``__float__``
blocks, raises, hangs or ends its own process (``relax_core.testing.hostile_reward``, under process isolation
and under the default thread isolation, where ``os._exit`` used to end the run without a word and 10**400 to
kill it with an OverflowError). The run finishes;
each bad thing is skipped or scored the fallback, counted in summary.json and said in one console line per
reason; no traceback; the loss stays finite (a reward of inf or NaN cannot reach the weights)."""

from __future__ import annotations

import json
import math

import pytest

from relax_app.cli import main
from relax_core.testing import build_tiny_checkpoint

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
    argv += ["--rm-type", "relax_core.testing:hostile_reward", "--reward-isolation", isolation]
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
