"""The live view of a run and the commands around a run directory and its checkpoints: `relax status` /
`relax watch` on a fully-async run while it goes (then stopped by SIGTERM: the summary says the steps it
trained), `relax summary`, `relax eval`, `relax export`, `relax --version`, and metrics.jsonl with one line
per step."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _tiny import run_flags

RELAX = [sys.executable, "-m", "relax_app.cli"]


def relax(*args: str) -> subprocess.CompletedProcess:
    """``relax ARGS`` in this process (the CLI's own ``main``, as the ``relax`` script calls it), its output
    captured: each command here needs no process of its own, and a Python start-up with torch costs seconds.
    The run the watch test stops by a signal, and the watch that follows it, are processes."""
    import contextlib
    import io

    from relax_app.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # (argparse's errors)
            code = e.code if isinstance(e.code, int) else 2
    return subprocess.CompletedProcess(["relax", *args], code, out.getvalue(), err.getvalue())


def _spans(out: Path) -> list[dict]:
    """The complete events of the run's trace.json so far."""
    if not (out / "trace.json").is_file():
        return []
    return [e for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_watch_shows_a_fully_async_run_live_then_its_stop_by_signal(tiny_run_inputs, tmp_path):
    out = tmp_path / "run"
    # many steps, a little reward latency: the run outlasts what the test reads; SIGTERM ends it early
    flags = run_flags(tiny_run_inputs, out, num_rollout=1000, eval_interval=1000, reward_delay_s=0.05)
    train = subprocess.Popen(
        [*RELAX, "train", *flags, "--fully-async", "--max-staleness", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(train.stdout), daemon=True).start()
    watch = subprocess.Popen(
        [*RELAX, "watch", str(out), "--interval", "0.5", "--timeout", "600"],
        stdout=subprocess.PIPE,
        text=True,
    )
    frames: list[str] = []
    threading.Thread(target=lambda: frames.extend(watch.stdout), daemon=True).start()
    try:
        from relax_app.watch import render
        from relax_core.live import read_status

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and train.poll() is None:  # (polled here: no process per look)
            try:
                s = read_status(out)
            except FileNotFoundError:
                s = None
            flushed = {e["name"] for e in _spans(out)}  # (the trace as flushed so far)
            if s is not None and s.state == "running" and s.step >= 2 and {"generate", "train"} <= flushed:
                break
            time.sleep(0.5)
        assert train.poll() is None, f"the run ended before the test saw it going:\n{''.join(log)[-3000:]}"
        assert s is not None and s.step >= 2, render(s) if s else "no status.json"
        snap = relax("status", str(out))  # the command, while the run goes
        assert snap.returncode == 0 and train.poll() is None, snap.stderr
        seen = snap.stdout
        assert re.search(r"state running  step ([2-9]|\d\d+)/1000", seen), seen
        # every role with its state; the ones holding the policy with their weight version
        table = seen.split("\nrole ", 1)[1].splitlines()[1:]
        roles = {line.split()[0]: line.split() for line in table if line.split()}
        for name in ("rollout", "actor", "advantages"):
            assert name in roles and roles[name][1] == "running", seen
        assert re.fullmatch(r"v\d+", roles["rollout"][2]) and re.fullmatch(r"v\d+", roles["actor"][2]), seen
        assert re.search(r"samples/s \d+\.\d\d", seen) and re.search(r"reward \d\.\d{3}", seen), seen
        assert re.search(r"bus depth \d+  oldest waiting (v\d+ \(\d+ behind the trainer|-)", seen), seen
        # the trace is flushed as the run goes (valid JSON at any moment: _spans parses it)
        assert {"generate", "train"} <= {e["name"] for e in _spans(out)}, _spans(out)

        train.send_signal(signal.SIGTERM)  # the run stops after its step, with a checkpoint
        assert train.wait(timeout=300) == 0, "".join(log)[-3000:]
        assert watch.wait(timeout=60) == 0  # the watch ends with the run
    finally:
        for p in (train, watch):
            if p.poll() is None:
                p.kill()
    text = "".join(frames)
    assert re.search(r"state running  step [1-9]\d*/1000", text) and "rollout" in text
    assert "state stopped" in text and "resume with --load" in text

    summary = json.loads((out / "summary.json").read_text())
    trained = [
        s for s, r in zip(_steps(out), (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r
    ]
    assert summary["steps"] == max(trained) == len(trained) < 1000  # what was trained, not --num-rollout
    assert summary["steps_planned"] == 1000 and summary["interrupted_at"]
    said = relax("summary", str(out)).stdout
    assert f"steps {summary['steps']} of 1000" in said and "stopped by a signal: resume with --load" in said


@pytest.fixture(scope="module")
def saved_run(tiny_run_inputs, tmp_path_factory):
    """A 2-step colocate run with held-out evaluation and --save; its output dir and checkpoint root."""
    root = tmp_path_factory.mktemp("saved")
    out, save = root / "run", root / "ckpt"
    flags = run_flags(
        tiny_run_inputs, out, num_rollout=2, eval_interval=10, eval_data=tiny_run_inputs.eval_path, save=save
    )
    done = relax("train", *flags, "--colocate")
    assert done.returncode == 0, done.stderr[-3000:]
    return out, save


@pytest.mark.integration
def test_metrics_jsonl_has_one_line_per_step_and_the_final_accuracy_on_the_last(saved_run):
    out, _ = saved_run
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]  # (was 0, 1, 2, 2: the final evaluation a line of its own)
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[-1] and "train/loss" in rows[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["interrupted_at"] is None
    assert summary["heldout_accuracy_after"] == rows[-1]["eval/accuracy"]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == 2 and set(status["roles"]) >= {"rollout", "actor"}


@pytest.mark.integration
def test_export_writes_a_model_directory_that_loads_with_its_tokenizer(saved_run, tiny_run_inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, save = saved_run
    done = relax("export", str(save), str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (
        tok("1+2=")["input_ids"]
        == AutoTokenizer.from_pretrained(tiny_run_inputs.model_path)("1+2=")["input_ids"]
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size >= len(tok)
    assert relax("export", str(save), str(tmp_path / "hf")).returncode == 2  # not over a directory in use


@pytest.mark.integration
def test_export_of_a_checkpoint_without_tokenizer_takes_its_run_s_or_asks(
    saved_run, tiny_run_inputs, tmp_path
):
    """A checkpoint written before model/ carried the tokenizer: it comes from the model the run trained from
    (recorded in the checkpoint); with nothing recorded either, the command says to give --tokenizer."""
    from relax_core.checkpoints import write_manifest
    from relax_core.hf_files import tokenizer_missing

    _, save = saved_run
    old = tmp_path / "old" / "step_000002"
    shutil.copytree(sorted(save.glob("step_*"))[-1], old)
    for f in (old / "model").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            f.unlink()
    write_manifest(old)  # (whole, as such a checkpoint was)
    assert tokenizer_missing(old / "model")
    done = relax("export", str(old), str(tmp_path / "a"))
    assert done.returncode == 0, done.stderr
    assert not tokenizer_missing(tmp_path / "a")

    state = json.loads((old / "run_state.json").read_text())
    state.pop("model_path"), state.pop("output_dir")
    (old / "run_state.json").write_text(json.dumps(state))
    write_manifest(old)
    refused = relax("export", str(old), str(tmp_path / "b"))
    assert refused.returncode == 2 and "give --tokenizer DIR" in refused.stderr
    given = relax("export", str(old), str(tmp_path / "b"), "--tokenizer", tiny_run_inputs.model_path)
    assert given.returncode == 0 and not tokenizer_missing(tmp_path / "b")


@pytest.mark.integration
def test_eval_scores_a_checkpoint_on_its_run_s_held_out_data(saved_run, tiny_run_inputs, tmp_path, capsys):
    from relax_app.checkpoint_tools import eval_main

    out, save = saved_run
    done = relax("eval", str(save))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["step"] == 2 and result["data"] == tiny_run_inputs.eval_path and result["samples"] == 20
    # greedy and the same model: the run's own final evaluation
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert result["accuracy"] == pytest.approx(final["eval/accuracy"])
    # another data file and reward, given (in this process: the command's function, as the CLI calls it)
    data = tmp_path / "two.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(2)))
    assert eval_main([str(save), "--data", str(data), "--eval-rm-type", "math"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["samples"] == 2
    assert eval_main([str(save), "--data", str(tmp_path / "none.jsonl")]) == 2
    assert "none.jsonl: no such file" in capsys.readouterr().err
    # a file of other column names: one line naming --data, the columns it has and the flags to give
    # (it was a traceback naming --prompt-data)
    other = tmp_path / "qa.jsonl"
    other.write_text(
        "".join(json.dumps({"question": f"{i}+2=", "answer": str(i + 2)}) + "\n" for i in range(3))
    )
    assert eval_main([str(save), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"relax: --data {other}: no usable rows") and "(the row has: question, answer)" in err
    )
    assert err.rstrip().endswith("name its columns with --input-key and --label-key")
    assert (
        eval_main([str(save), "--data", str(other), "--input-key", "question", "--label-key", "answer"]) == 0
    )
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["samples"] == 3


def test_version_names_every_relax_package():
    done = relax("--version")
    assert done.returncode == 0
    for name in (
        "relax-core",
        "relax-bus",
        "relax-rollout",
        "relax-train",
        "relax-rewards",
        "relax-multimodal",
    ):
        assert re.search(rf"^  {name} +\d+\.\d+", done.stdout, re.M), done.stdout
    assert done.stdout.startswith("relax ")
