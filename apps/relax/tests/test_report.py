"""The end-of-run summary counts what the reward scorer refused (it read a key the scorer never wrote, and
said ``reward_failures: {}`` whatever happened)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from relax_app.report import console_lines, write_report  # noqa: E402
from relax_bus import DataBus  # noqa: E402
from relax_core.config import RelaxConfig  # noqa: E402
from relax_core.controller import RunResult, bus_config  # noqa: E402
from relax_rollout.worker import RolloutWorker  # noqa: E402
from relax_testing import build_tiny_checkpoint  # noqa: E402


def test_summary_counts_reward_failures_by_reason_and_unlabeled_samples(tmp_path):
    rows = [{"prompt": "1+1=", "label": {"answer": "2"}}, {"prompt": "2+2=", "label": None}]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    model = build_tiny_checkpoint(tmp_path / "model")
    cfg = RelaxConfig.model_validate(
        {
            "model": {"hf_checkpoint": model},
            "data": {"prompt_data": str(data)},
            "run": {"output_dir": str(tmp_path / "run")},
            "rollout": {
                "rollout_batch_size": 2,
                "n_samples_per_prompt": 2,
                "rollout_max_response_len": 3,
                "rm_type": "math",
            },
        }
    )
    worker = RolloutWorker(cfg, DataBus(bus_config(cfg)), model, str(data), torch_threads=1)
    worker.produce(step=0)
    result = RunResult(
        history=[],
        wall_s=1.0,
        rl_wall_s=1.0,
        samples=4,
        mode="colocate",
        max_staleness=0,
        rollout_stats=worker.get_record().stats,
    )
    (tmp_path / "run").mkdir(exist_ok=True)  # (the rollout role journals there already)
    summary = write_report(cfg, result)
    assert summary["reward_failures"] == {"raised:ValueError": 2}  # the dict label's two samples
    assert summary["reward_unlabeled"] == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["reward_failures"] == {
        "raised:ValueError": 2
    }
    # skips are in the summary too, with what went wrong, and one console line per reason
    assert summary["skipped_rows"] == 1 and summary["skipped_examples"] == [
        f"{data}:3: not valid JSON (Expecting value); fix or remove the line"
    ]
    assert console_lines(summary) == [
        "1 dataset rows skipped (malformed; see skipped_examples)",
        "2 rewards failed (raised:ValueError) and scored the fallback",
        "2 samples scored without a label",
    ]
    # a torn journal line (a kill mid-write) is counted; a non-finite figure is written as null, never Infinity
    with open(tmp_path / "run" / "rollout_journal.jsonl", "a") as f:
        f.write('{"begin": 1, "sta\n')
    result.history = [{"step": 0, "rollout/reward_mean": float("inf")}]
    summary = write_report(cfg, result)
    assert summary["journal_torn_lines"] == 1 and summary["reward_first"] is None
    assert "Infinity" not in (tmp_path / "run" / "summary.json").read_text()
    assert "1 torn lines in the rollout journal skipped (a kill mid-write)" in console_lines(summary)


def test_plot_is_titled_by_the_run_and_scaled_to_its_data_and_steps_say_what_was_trained(
    tmp_path, monkeypatch
):
    """The plot said "Relax demo" with a 0-1 axis for every run; summary.json said --num-rollout's steps
    for a run a signal stopped early."""
    from relax_app import report

    figures = []
    real = report.curves_figure
    monkeypatch.setattr(report, "curves_figure", lambda *a: figures.append(real(*a)) or figures[-1])
    out = tmp_path / "gsm8k-lr3e-6"
    cfg = RelaxConfig.model_validate(
        {
            "run": {"output_dir": str(out), "mode": "fully_async", "max_staleness": 2},
            "train": {"num_rollout": 100},
        }
    )
    out.mkdir()
    history = [{"step": 0, "eval/accuracy": 0.41}]
    history += [{"step": k, "rollout/reward_mean": -2.0 + k / 10} for k in range(1, 92)]
    history += [{"step": 91, "eval/accuracy": 0.45}]
    result = RunResult(history, 10.0, 9.0, 91 * 8, "fully_async", 2, interrupted_at=str(tmp_path / "ckpt"))
    summary = write_report(cfg, result)
    assert summary["steps"] == 91 and summary["steps_planned"] == 100
    assert summary["interrupted_at"] == str(tmp_path / "ckpt")
    ax = figures[-1].axes[0]
    assert ax.get_title() == "gsm8k-lr3e-6 (fully_async, max_staleness=2, 91/100 steps)"
    lo, hi = ax.get_ylim()
    assert -2.8 < lo < -1.9 and 7.1 < hi < 7.9  # the rewards' range (-1.9 .. 7.1) with a margin, not 0-1
    assert (out / "curves.png").stat().st_size > 0
