"""The Controller: runs one RL job in colocate or fully-async mode.

Where things are: the roles and how they connect — :mod:`relax_core.roles`; colocate's step loop —
:mod:`relax_core.colocate`; the fully-async driver loop — :mod:`relax_core.fully_async`, its roles'
supervision and restarts — :mod:`relax_core.async_run`; what both modes share (inputs, result, Ray,
signals) — :mod:`relax_core.run`; the Role interface the drivers call — :mod:`relax_core.role`. The
roles come from a registry (entry points the rollout and train packages declare, loaded when a run
starts), so relax-core itself depends on neither torch nor the rollout/train packages.
"""

from __future__ import annotations

import os
from pathlib import Path

from relax_core.async_run import AsyncRun
from relax_core.colocate import run_colocate
from relax_core.config import RelaxConfig
from relax_core.fully_async import run_fully_async
from relax_core.health import first_line
from relax_core.live import LiveStatus
from relax_core.notify import Notifier
from relax_core.ownership import (
    RunLocks,
    claim_branch,
    claim_save_dir,
    crashed_in_reward,
    data_settings,
    start_record,
    train_settings,
)
from relax_core.resume import CheckpointDir
from relax_core.roles import RoleRegistry, bus_config
from relax_core.run import RunInputs, RunResult, StopOnSignal, check_teacher_tokenizer, start_ray

# (names other packages and tests import from here)
__all__ = ["Controller", "RunInputs", "RunResult", "bus_config", "start_ray"]


class Controller:
    def __init__(self, cfg: RelaxConfig, inputs: RunInputs, roles: RoleRegistry | None = None) -> None:
        """``roles``: the role registry (default: the roles the installed packages register,
        :meth:`RoleRegistry.installed`; :meth:`RoleRegistry.with_role` adds one)."""
        # absolute paths: Ray workers do not share our working directory
        absolute = {k: os.path.abspath(v) if isinstance(v, str) else v for k, v in vars(inputs).items()}
        run = cfg.run.model_copy(update={"output_dir": os.path.abspath(cfg.run.output_dir)})
        train = cfg.train.model_copy(
            update={
                k: os.path.abspath(v) for k in ("save", "load") if isinstance(v := getattr(cfg.train, k), str)
            }
        )
        self.given = cfg
        """The settings as given (``<output_dir>/config.json``)."""
        self.cfg = cfg.model_copy(update={"run": run, "train": train})
        self.inputs = RunInputs(**absolute)
        self.roles = roles
        self.interrupted_at: str | None = None
        """The checkpoint written when a signal stopped the run early (None: it ran to the end)."""
        self.async_run: AsyncRun | None = None
        """Fully async: the running roles and their supervision (tests inject faults through it)."""
        self._stop = StopOnSignal()

    def request_stop(self) -> None:
        """Stop the run after the current step, with a checkpoint, as SIGTERM does: for code that drives a
        run from another thread (a notebook, a scheduler's pre-emption hook, a test) and must not signal
        its whole process (``ray.init`` leaves its own SIGTERM handler behind, which exits)."""
        self._stop.requested = True

    def _record(self) -> None:
        """The run's id and its data's fingerprint (``relax_core.ownership``), checked against the checkpoint
        --load resumes; a --save holding checkpoints without --load, or after the one --load names (a branch), is
        emptied of them with --overwrite, else refused."""
        from relax_core.checkpoints import latest_checkpoint

        cfg, loaded = self.cfg, None
        # (written here, under the locks: written before them, a refused run replaced the running run's
        # settings, which `relax eval` of its checkpoints then used)
        (Path(cfg.run.output_dir) / "config.json").write_text(self.given.model_dump_json(indent=1))
        if why := crashed_in_reward(cfg.run.output_dir):  # (colocate: the run's own process was the one)
            print(f"[relax] WARNING: the previous run in {cfg.run.output_dir} ended without a word: {why}")
        if cfg.train.load:
            path = latest_checkpoint(cfg.train.load, trust_unverified=cfg.train.trust_unverified)
            loaded = {**CheckpointDir(path).run_state(), "path": path}
            if cfg.train.save:
                claim_branch(cfg.train.save, path, cfg.run.overwrite)
        elif cfg.train.save:
            claim_save_dir(cfg.train.save, cfg.run.overwrite)
        start_record(
            cfg.run.output_dir,
            self.inputs.prompt_path,
            loaded,
            cfg.run.allow_data_change,
            data_settings(cfg),
            self.inputs.model_path,
            train_settings(cfg),
        )

    def run(self) -> RunResult:
        cfg = self.cfg
        notifier = Notifier(cfg.run.notify_urls, run_name=Path(cfg.run.output_dir).name)
        staleness = f" (max staleness {cfg.run.max_staleness})" if cfg.run.max_staleness else ""
        notifier.start(
            {
                "mode": cfg.run.mode + staleness,
                "steps": cfg.train.num_rollout,
                "samples per step": cfg.samples_per_rollout,
                "model": self.inputs.model_path,
                "output": cfg.run.output_dir,
            }
        )
        try:
            with RunLocks([("--output-dir", cfg.run.output_dir), ("--save", cfg.train.save)]):
                self._record()
                live = LiveStatus(cfg)  # <output_dir>/status.json: what `relax watch` shows
                live.update(force=True)
                try:
                    if cfg.uses_teacher:
                        check_teacher_tokenizer(cfg, self.inputs)
                    if cfg.lora.enabled:  # (a target the model lacks: refused before any role loads it)
                        from relax_core.lora import check_targets

                        check_targets(self.inputs.model_path, cfg.lora)
                    if cfg.run.mode == "colocate":
                        result = run_colocate(cfg, self.inputs, self._stop, live, self.roles)
                    else:
                        threads = cfg.run.torch_threads or 1
                        self.async_run = AsyncRun(cfg, self.inputs, notifier, threads, self.roles)
                        result = run_fully_async(self.async_run, self._stop, live)
                except BaseException as exc:
                    live.finish("failed", first_line(exc, 500))  # (a Ray error: what was raised, and where)
                    raise
                if result.interrupted_at:
                    live.finish("stopped", f"stopped by signal; resume with --load {result.interrupted_at}")
                else:
                    live.finish("done")
        except BaseException as exc:
            notifier.failure(exc)
            raise
        self.interrupted_at = result.interrupted_at
        notifier.finish(result)
        return result
