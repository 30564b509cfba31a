"""A run owns its directories and knows its data (issue 36), through the real CLI: a second run on the same
--output-dir is refused naming the first; a fresh run into a --save holding another run's checkpoints is
refused (or, with --overwrite, deletes them first); a prompt file changed since the checkpoint is refused at
--load and at a rollout restart, naming what changed; the run's own restarts take only its checkpoints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
from _tiny import run_flags

from relax_app.cli import main
from relax_core.checkpoints import latest_checkpoint, save_atomically
from relax_core.ownership import DataChanged, read_record, start_record
from relax_core.resume import CheckpointDir

HOLD = """
import sys, time
from relax_core.ownership import RunLocks
with RunLocks([("--output-dir", sys.argv[1])]):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(tiny_run_inputs, tmp_path, capsys):
    """Before: both ran and exited 0; metrics.jsonl held steps 1-6 twice. Then (#49): the refused run first
    wrote its settings over the running run's config.json (which `relax eval` of its checkpoints reads)."""
    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "holding"
        settings = '{"the running run": "its settings"}'
        (out / "config.json").write_text(settings)
        assert main(["train", *run_flags(tiny_run_inputs, out, num_rollout=1)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"relax: --output-dir {out}: another run is using it (pid {other.pid} on ")
        assert not (out / "metrics.jsonl").exists()
        assert (out / "config.json").read_text() == settings
    finally:
        other.kill()
        other.wait()


def test_a_fresh_run_into_another_run_s_save_is_refused_or_overwrites(tiny_run_inputs, tmp_path, capsys):
    """Before: the fresh run kept the other run's checkpoints (save returned early where a step existed)
    and its restarts would have resumed the other run."""
    save = tmp_path / "save"
    foreign = save / "step_000001"
    foreign.mkdir(parents=True)
    (foreign / "meta.json").write_text('{"version": 1}')
    flags = run_flags(tiny_run_inputs, tmp_path / "run", num_rollout=1, save=str(save))
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert f"--save {save} holds 1 checkpoint(s) of another run (step_000001 .. step_000001)" in err
    assert "--overwrite" in err and foreign.exists()
    assert main(["train", *flags, "--overwrite"]) == 0
    mine = read_record(tmp_path / "run")["run_id"]
    state = CheckpointDir(save / "step_000001").run_state()
    assert state["run_id"] == mine and state["data_fingerprint"]["sha256"]


def test_changed_data_is_refused_at_load_and_at_a_rollout_restart(tiny_run_inputs, tmp_path, capsys):
    """Before: rows inserted before --load trained other prompts at steps 4-6, reported ok; a file rewritten
    mid-run was read by the restarted rollout."""
    prompts = tmp_path / "train.jsonl"
    shutil.copy(tiny_run_inputs.prompt_path, prompts)
    save, out = tmp_path / "save", tmp_path / "run"
    flags = run_flags(tiny_run_inputs, out, num_rollout=1, save=str(save), prompt_data=str(prompts))
    assert main(["train", *flags]) == 0
    rows = prompts.read_text().splitlines()
    prompts.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # two rows swapped
    assert main(["train", *flags, "--load", str(save), "--num-rollout", "2"]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint loaded ({save / 'step_000001'}) trained on other data: {prompts} changed" in err
    assert "--allow-data-change" in err
    prompts.write_text("\n".join(rows) + "\n")  # the file as it was: settings that draw other prompts
    assert main(["train", *flags, "--load", str(save), "--num-rollout", "2", "--seed", "7"]) == 2
    assert "drew its prompts with other settings: --seed 0 -> 7" in capsys.readouterr().err
    prompts.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")
    # a rollout role restarted mid-run re-reads the file: compared with the run's own record
    from relax_app.cli_config import build_config
    from relax_rollout.worker import RolloutWorker

    cfg = build_config(None, flags)
    start_record(str(out), str(tiny_run_inputs.prompt_path), None, False)  # a run on the original file
    with pytest.raises(DataChanged, match="this run trained on other data"):
        RolloutWorker(cfg.model_copy(), None, tiny_run_inputs.model_path, str(prompts))


def test_a_run_s_restarts_take_only_its_own_checkpoints(tmp_path):
    def write(run_id):
        def w(d):
            (d / "meta.json").write_text(json.dumps({"version": 1}))
            CheckpointDir(d).write_run_state([], [], None, {"run_id": run_id})

        return w

    save_atomically(tmp_path / "step_000002", write("mine"))
    time.sleep(0.01)
    save_atomically(tmp_path / "step_000004", write("theirs"))
    assert latest_checkpoint(tmp_path) == str(tmp_path / "step_000004")  # --load: the user's choice
    assert latest_checkpoint(tmp_path, "mine") == str(tmp_path / "step_000002")
    with pytest.raises(FileNotFoundError, match="written by another run"):
        latest_checkpoint(tmp_path, "someone")


FSIZE = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit fails with EFBIG instead)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from relax_app.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_save_that_fails_says_what_and_where_and_stops_cleanly(tiny_run_inputs, tmp_path):
    """A disk that refuses the checkpoint's files (here: a file-size limit, EFBIG; a full disk is ENOSPC
    through the same path). Before: torch's ``RuntimeError: unexpected pos ...`` traceback naming no path."""
    save = tmp_path / "save"
    flags = run_flags(tiny_run_inputs, tmp_path / "run", num_rollout=2, save=str(save), save_interval=1)
    out = subprocess.run(
        [sys.executable, "-c", FSIZE, str(40 << 10), "train", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    err = out.stderr.strip().splitlines()
    assert out.returncode == 1, out.stderr[-2000:]
    assert err[-1].startswith(f"relax: the run stopped: writing checkpoint {save / 'step_000001'} failed (")
    assert "the previous checkpoints are kept" in err[-1] and "Traceback" not in out.stderr
    assert list(save.glob(".*writing*")) == [] and not (save / "step_000001").exists()


def test_an_unwritable_save_or_a_disk_too_small_is_refused_before_the_first_step(
    tiny_run_inputs, tmp_path, capsys
):
    (tmp_path / "a_file").write_text("")
    flags = run_flags(
        tiny_run_inputs, tmp_path / "run", num_rollout=1, save=str(tmp_path / "a_file" / "save")
    )
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"relax: --save {tmp_path / 'a_file' / 'save'}: cannot write there (")
        and "\n" not in err
    )
    from relax_core.checkpoints import check_writable

    with pytest.raises(ValueError, match=r"MiB free, one checkpoint needs about \d+ MiB"):
        check_writable("--save", tmp_path, need_bytes=1 << 60)


def test_one_directory_given_twice_is_locked_once(tmp_path):
    from relax_core.ownership import DirectoryInUse, RunLocks

    with RunLocks([("--output-dir", str(tmp_path)), ("--save", str(tmp_path / "."))]):
        with pytest.raises(
            DirectoryInUse, match="another run is using it"
        ):  # (another lock, as another run's)
            with RunLocks([("--output-dir", str(tmp_path))]):
                pass


POOL_UNDER_LOCK = """
import sys, time
from relax_core.ownership import RunLocks
from relax_rewards.isolation import ProcessPool
with RunLocks([("--output-dir", sys.argv[1])]):
    pool = ProcessPool()
    pool.prestart(2)
    assert pool.submit("math", "2", "2", None).result(timeout=60).score == 1.0
    print(" ".join(str(w.process.pid) for w in pool._idle), flush=True)
    time.sleep(600)
"""


def test_a_run_killed_with_its_reward_workers_alive_leaves_no_lock_and_no_worker(tmp_path):
    """#49: after `kill -9` of a run with --reward-isolation process, its forked reward workers held the
    run's lock (a flock is shared across a fork) and waited for ever (each held both ends of its pipe, so
    no end of file came): the directory stayed locked. Now they end with their parent and hold no lock."""
    import os
    import signal

    from relax_core.ownership import RunLocks

    out = tmp_path / "run"
    run = subprocess.Popen(
        [sys.executable, "-c", POOL_UNDER_LOCK, str(out)], stdout=subprocess.PIPE, text=True
    )
    workers = [int(p) for p in run.stdout.readline().split()]
    assert len(workers) == 2
    os.kill(run.pid, signal.SIGKILL)
    run.wait()

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return open(f"/proc/{pid}/stat").read().split()[2] != "Z"  # (a zombie has ended)

    deadline = time.monotonic() + 10
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in workers if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"reward workers {left} outlived their run"
    with RunLocks([("--output-dir", str(out))]):  # (free: no child holds it)
        pass


def _last_lr(out) -> float:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/lr" in r][-1]["train/lr"]


def test_load_applies_the_optimizer_settings_given_and_refuses_other_adapter_settings(
    tiny_run_inputs, tmp_path, capsys, caplog
):
    """#49, one rule for a setting that differs from the checkpoint's (``TRAIN_SETTINGS``). Before: --lr with
    --load was ignored (the optimizer's saved groups won; config.json said otherwise), and a LoRA checkpoint
    loaded with another --lora-alpha was rescaled without a word, or with another rank or none a traceback."""
    save, out = tmp_path / "save", tmp_path / "run"
    assert main(["train", *run_flags(tiny_run_inputs, out, num_rollout=1, save=str(save), lr=1e-6)]) == 0
    assert _last_lr(out) == 1e-6
    resumed = run_flags(tiny_run_inputs, out, num_rollout=2, save=str(save), lr=3e-4)
    assert main(["train", *resumed, "--load", str(save)]) == 0
    assert _last_lr(out) == 3e-4  # (the setting given, as config.json says)
    assert json.loads((out / "config.json").read_text())["train"]["lr"] == 3e-4
    assert "--lr 1e-06 -> 0.0003: the settings given apply" in caplog.text

    lora_save, lora_out = tmp_path / "lora", tmp_path / "lora_run"
    lora = dict(num_rollout=1, save=str(lora_save), lora_rank=4, lora_alpha=8)
    assert main(["train", *run_flags(tiny_run_inputs, lora_out, **lora)]) == 0
    capsys.readouterr()
    for changed, said in [
        ({"lora_alpha": 16}, "--lora-alpha 8 -> 16"),
        ({"lora_rank": None, "lora_alpha": None}, "--lora-rank 4 -> 0"),  # (without LoRA)
        ({"lora_target_modules": ["q_proj"]}, "--lora-target-modules ['all-linear'] -> ['q_proj']"),
    ]:
        flags = run_flags(tiny_run_inputs, lora_out, **{**lora, "num_rollout": 2, **changed})
        assert main(["train", *flags, "--load", str(lora_save)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("relax: the checkpoint loaded") and said in err and "\n" not in err, err
    full = run_flags(tiny_run_inputs, out, num_rollout=3, save=str(save), lora_rank=4)  # a full checkpoint
    assert main(["train", *full, "--load", str(save)]) == 2
    assert "--lora-rank 0 -> 4" in capsys.readouterr().err


def test_lora_targets_peft_cannot_adapt_or_a_tied_embedding_are_refused_before_any_model_loads(
    tiny_run_inputs, tmp_path, capsys
):
    """#49 (through `relax train`; the tiny model ties embed_tokens and lm_head): an adapter on lm_head was
    served merged into the weight both share (another model than the one trained, no warning), and
    --lora-target-modules mlp passed the check and failed inside peft in every role."""
    for targets, said in [
        (["lm_head"], "ties embed_tokens and lm_head"),
        (["q_proj", "mlp"], "'mlp' is a Qwen3MLP"),
    ]:
        flags = run_flags(
            tiny_run_inputs, tmp_path / "run", num_rollout=1, lora_rank=4, lora_target_modules=targets
        )
        assert main(["train", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("relax: ") and said in err, err


def test_a_branch_into_its_own_save_is_refused_or_replaces_the_later_steps(tiny_run_inputs, tmp_path, capsys):
    """#49: `--load S/step_1 --save S` with other settings exited 0 without saving its steps (S kept the old
    run's step_2 and step_3: a save keeps a whole checkpoint at its step) and a restart jumped to them."""
    save = tmp_path / "save"
    flags = run_flags(tiny_run_inputs, tmp_path / "run", num_rollout=3, save=str(save), save_interval=1)
    assert main(["train", *flags]) == 0
    old = {p.name: (p / "trainer_state.pt").read_bytes() for p in sorted(save.glob("step_*"))}
    assert list(old) == ["step_000001", "step_000002", "step_000003"]
    branch = [
        *run_flags(tiny_run_inputs, tmp_path / "branch", num_rollout=3, save=str(save), save_interval=1)
    ]
    branch += ["--load", str(save / "step_000001"), "--seed", "0", "--lr", "1e-3"]
    assert main(["train", *branch]) == 2
    err = capsys.readouterr().err
    assert "holds 2 checkpoint(s) after the one loaded (step_000001): step_000002 .. step_000003" in err, err
    assert "--overwrite" in err
    assert main(["train", *branch, "--overwrite"]) == 0
    new = {p.name: (p / "trainer_state.pt").read_bytes() for p in sorted(save.glob("step_*"))}
    assert list(new) == list(old) and new["step_000001"] == old["step_000001"]
    assert (
        new["step_000002"] != old["step_000002"] and new["step_000003"] != old["step_000003"]
    )  # the branch's
