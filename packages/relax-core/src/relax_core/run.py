"""What both run modes share: the run's inputs and result, Ray start-up, the stop-on-signal guard, the
progress bar, the teacher's checks, the final evaluation and the trace file."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_core.config import RelaxConfig
from relax_core.optional import import_ray
from relax_core.trace import write_trace

if TYPE_CHECKING:
    from types import FrameType


@dataclass
class RunInputs:
    model_path: str
    prompt_path: str
    eval_path: str | None = None
    ref_model_path: str | None = None
    teacher_model_path: str | None = None


@dataclass
class RunResult:
    history: list[dict[str, Any]]
    wall_s: float
    rl_wall_s: float
    samples: int
    mode: str
    max_staleness: int
    rollout_stats: dict[str, Any] = field(default_factory=dict)
    bus_stats: dict[str, Any] = field(default_factory=dict)
    audit: dict[str, Any] = field(default_factory=dict)
    """Per-consumer consumed ids, trained ids, weight checksums per version (for tests)."""
    trace_path: str | None = None
    """The run's Chrome-trace timeline (--trace), else None."""
    interrupted_at: str | None = None
    """The checkpoint written when a signal stopped the run early (None: it ran to the end)."""

    @property
    def eval_curve(self) -> list[tuple[int, float]]:
        return [(int(h["step"]), float(h["eval/accuracy"])) for h in self.history if "eval/accuracy" in h]


def start_ray(cfg: RelaxConfig) -> bool:
    """Ray for the run: the running cluster that ``--ray-address`` or ``RAY_ADDRESS`` names (several nodes:
    ``ray start`` on each, then ``relax train --ray-address <head>:6379 ...`` on the head), else a local cluster started here,
    unless this process is connected already. True when this call connected (the run disconnects at the
    end; a cluster started here stops with it, one started with ``ray start`` keeps running)."""
    ray = import_ray("--fully-async (and a megatron trainer of several ranks)")
    if ray.is_initialized():
        return False
    address = (cfg.run.ray_address or os.environ.get("RAY_ADDRESS", "")).strip()
    if address:  # the nodes' CPUs and GPUs were set by `ray start`; Ray refuses num_cpus here
        if cfg.run.num_cpus is not None:
            raise ValueError(
                f"--num-cpus sizes the local Ray cluster a run starts, but --ray-address / RAY_ADDRESS={address} "
                "connects to a running one (its nodes' CPUs are set by `ray start --num-cpus`): drop one of them"
            )
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        return True
    ray.init(
        address="local",  # a new cluster even where `ray start` left one (RAY_ADDRESS chooses that one)
        num_cpus=cfg.run.num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
        _system_config=ROLE_PRIORITY,
    )
    return True


ROLE_PRIORITY = {"worker_niceness": 0}
"""Ray starts its workers at nice 15 (its raylet and GCS first); relax's roles are the run's work. Niced,
they were starved by any process of normal priority: fully async with one busy process per core made no
step in 9 minutes, where colocate (in the driver, nice 0) ran at 287 samples/s (BENCHMARKS.md, #51). A
cluster started with ``ray start`` is the user's: ``RAY_worker_niceness=0 ray start ...`` does the same."""


def stop_ray() -> None:
    """Disconnect (and stop a cluster this process started)."""
    import_ray("--fully-async").shutdown()


def start_ray_for_ranks(cfg: RelaxConfig) -> bool:
    """Colocate with a megatron trainer of several ranks: ranks 1..N-1 are Ray actors, so connect to Ray
    (see :func:`start_ray`)."""
    t = cfg.train
    if t.train_backend != "megatron" or t.actor_num_nodes * t.actor_num_gpus_per_node <= 1:
        return False
    return start_ray(cfg)


def offloads(cfg: RelaxConfig) -> bool:
    """Colocate: whether rollout and training hand the devices to each other (--offload; default: when
    CUDA is available)."""
    if cfg.run.offload is not None:
        return cfg.run.offload
    import torch

    return torch.cuda.is_available()


def teacher_path(cfg: RelaxConfig, inputs: RunInputs) -> str:
    path = inputs.teacher_model_path or cfg.model.teacher_checkpoint
    assert path is not None, "called when cfg.uses_teacher: --teacher-checkpoint is set"
    return os.path.abspath(path)


def check_teacher_tokenizer(cfg: RelaxConfig, inputs: RunInputs) -> None:
    """Distillation compares log-probs token by token: the teacher must read the same token ids."""
    from transformers import AutoTokenizer

    student, teacher = inputs.model_path, teacher_path(cfg, inputs)
    a, b = AutoTokenizer.from_pretrained(student), AutoTokenizer.from_pretrained(teacher)
    if a.get_vocab() != b.get_vocab():
        raise ValueError(
            f"--teacher-checkpoint {teacher} has a different tokenizer from the policy {student} "
            f"({len(b)} vs {len(a)} tokens); on-policy distillation compares log-probs token by token, "
            "so both must share one tokenizer"
        )


def final_eval(
    cfg: RelaxConfig, inputs: RunInputs, history: list[dict[str, Any]], do_eval: Callable[[], object]
) -> None:
    """Evaluate at the last step unless the run's last evaluation was there already."""
    last = [h for h in history if "eval/accuracy" in h]
    if inputs.eval_path and (not last or last[-1]["step"] != cfg.train.num_rollout):
        do_eval()


def trace_file(cfg: RelaxConfig, role_spans: list[list[dict[str, Any]]]) -> str:
    """Every role's spans into ``output_dir/trace.json`` (Chrome's trace format)."""
    return str(
        write_trace(Path(cfg.run.output_dir) / "trace.json", [s for spans in role_spans for s in spans])
    )


def checkpoint_dir(cfg: RelaxConfig) -> str:
    """Where a stop by signal writes its checkpoint: ``--save``, else ``output_dir/checkpoints``."""
    return cfg.train.save or os.path.join(cfg.run.output_dir, "checkpoints")


class StopOnSignal:
    """While active, SIGTERM and SIGINT ask the run to stop after the current step (with a checkpoint)
    instead of killing it; a second signal gets the previous handler (e.g. an immediate KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            prev = self._previous.get(signum)
            if callable(prev):
                prev(signum, frame)
            return
        self.requested = True

    def __enter__(self) -> StopOnSignal:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        import signal

        for sig, prev in self._previous.items():
            signal.signal(sig, prev)
        self._previous = {}


def progress_bar(cfg: RelaxConfig, start: int) -> Any:
    """A ``tqdm`` bar (``Any``: tqdm ships no types), None without --progress."""
    if not cfg.run.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=cfg.train.num_rollout, initial=start, desc=f"RL ({cfg.run.mode})", unit="step")


def bar_update(bar: Any, metrics: dict[str, Any]) -> None:
    if bar is None:
        return
    post = {"reward": f"{metrics['rollout/reward_mean']:.3f}"}
    if "critic/value_loss" in metrics:  # (PPO: the critic's fit, --advantage-estimator gae)
        post["value_loss"] = f"{metrics['critic/value_loss']:.3f}"
        post["ev"] = f"{metrics['critic/explained_variance']:.2f}"
    if "eval/accuracy" in metrics:
        post["eval"] = f"{metrics['eval/accuracy']:.3f}"
    bar.set_postfix(post)
    bar.update(1)
