"""Where every step's metrics go: metrics.jsonl, TensorBoard, Weights & Biases, ClearML.

The trainer hands each metrics dict (``{"step": int, "time": float, "rollout/...": ..., "train/...": ...}``)
to one :class:`MetricsService`, which passes it to every sink the config asks for:

- ``jsonl`` (always): ``output_dir/metrics.jsonl``, the whole dict as one JSON line per call;
- ``tensorboard`` (``--tensorboard``, the default): event files under ``output_dir/tensorboard``;
- ``wandb`` (``--wandb-project P``): a W&B run; ``--wandb-mode offline`` (the default) writes it under
  ``output_dir/wandb`` for a later ``wandb sync``;
- ``clearml`` (``--clearml-project P``): a ClearML task; ``--clearml-offline`` (the default) writes a local
  session for ``clearml-task --import-offline-session``.

TensorBoard, W&B and ClearML receive the numeric grouped metrics only (names with a ``/``). Their libraries
are imported when a sink is built, never when this module is: a library that is missing fails the run at
start-up with the flag and what to install. Logging never decides the run's fate: a sink that raises while
logging or closing is dropped with one warning naming it, and the other sinks go on (metrics.jsonl is
written first, so an exporter's failure never costs its line).

``SINKS`` maps a sink name to ``"module:Class"`` (or any callable) taking ``(cfg, output_dir)``; register
another exporter by adding to it.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from relax_core.config import RelaxConfig
from relax_core.optional import TENSORBOARD_INSTALL
from relax_core.registry import Registry

logger = logging.getLogger(__name__)


@runtime_checkable
class MetricsSink(Protocol):
    """One destination of the metrics: gets every step's dict, then one close()."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


SinkFactory = Callable[[RelaxConfig, Path], MetricsSink]

SINKS = Registry(
    "metrics sink",
    "relax.metrics_sinks",
    {
        "jsonl": "relax_core.metrics:JsonlSink",
        "tensorboard": "relax_core.metrics:TensorBoardSink",
        "wandb": "relax_core.metrics:WandbSink",
        "clearml": "relax_core.metrics:ClearMLSink",
    },
)
"""Sink name -> a factory ``(cfg, output_dir) -> MetricsSink`` (``"module:Class"``, or one put in by code)."""

_EVENT_FILES = itertools.count()

_NEEDS: dict[str, tuple[str, str]] = {
    # sink -> (the flag that turns it on, how to get its library)
    "tensorboard": (
        "--tensorboard",
        f"tensorboard: {TENSORBOARD_INSTALL} (or turn it off with --no-tensorboard)",
    ),
    "wandb": ("--wandb-project", "wandb: pip install 'relax-core[wandb]'"),
    "clearml": ("--clearml-project", "clearml: pip install 'relax-core[clearml]'"),
}


def _require(sink: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        flag, what = _NEEDS[sink]
        raise ImportError(f"{flag} needs {what}") from e


def scalars(metrics: Mapping[str, Any]) -> dict[str, int | float]:
    """The metrics the exporters get: grouped names (``train/loss``) with int or float values."""
    return {k: v for k, v in metrics.items() if "/" in k and isinstance(v, (int, float))}


def run_name(output_dir: str | Path) -> str:
    """The name a run gets in W&B and ClearML: its output directory's name."""
    return Path(output_dir).resolve().name or "relax"


def public_config(cfg: RelaxConfig) -> dict[str, Any]:
    """The config as a JSON-able dict for the experiment trackers, secrets left out: notify URLs carry
    tokens (only their scheme is kept) and the elastic API token is masked."""
    data = cfg.model_dump(mode="json")
    data["run"]["notify_urls"] = [u.split("://", 1)[0] + "://..." for u in data["run"]["notify_urls"]]
    if data["rollout"].get("elastic_token"):
        data["rollout"]["elastic_token"] = "***"
    return data


class JsonlSink:
    """``output_dir/metrics.jsonl``: the whole dict, one line per call, flushed (always on)."""

    def __init__(self, cfg: RelaxConfig, output_dir: Path) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """``output_dir/tensorboard``: one event per call holding a scalar per grouped numeric metric, flushed.

    Written with the ``tensorboard`` package alone — its event protos and its record writer (length, data
    and masked CRC-32C, the framing TensorBoard reads), the same pieces torch's ``SummaryWriter`` wraps —
    synchronously in this thread: no torch, no TensorFlow, no writer thread."""

    def __init__(self, cfg: RelaxConfig, output_dir: Path) -> None:
        self._event_pb2 = _require("tensorboard", "tensorboard.compat.proto.event_pb2")
        self._summary_pb2 = _require("tensorboard", "tensorboard.compat.proto.summary_pb2")
        record_writer = _require("tensorboard", "tensorboard.summary.writer.record_writer")
        logdir = Path(output_dir) / "tensorboard"
        logdir.mkdir(parents=True, exist_ok=True)
        # TensorBoard finds event files by this name ("tfevents"); the counter keeps two sinks of one
        # process apart within a second
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self.path = logdir / f"{name}.{next(_EVENT_FILES)}"
        self._writer = record_writer.RecordWriter(open(self.path, "wb"))  # noqa: SIM115 - closed in close()
        self._write(self._event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Any) -> None:
        self._writer.write(event.SerializeToString())
        self._writer.flush()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        Value = self._summary_pb2.Summary.Value
        values = [Value(tag=k, simple_value=float(v)) for k, v in scalars(metrics).items()]
        if values:
            summary = self._summary_pb2.Summary(value=values)
            self._write(self._event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def close(self) -> None:
        if not self._writer.closed:
            self._writer.close()


class WandbSink:
    """A Weights & Biases run named after the output directory, holding the config; offline mode writes
    ``output_dir/wandb/offline-run-*`` for a later ``wandb sync``."""

    def __init__(self, cfg: RelaxConfig, output_dir: Path) -> None:
        wandb = _require("wandb", "wandb")
        self.run = wandb.init(
            project=cfg.run.wandb_project,
            mode=cfg.run.wandb_mode,
            dir=str(output_dir),
            name=run_name(output_dir),
            config=public_config(cfg),
        )

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class ClearMLSink:
    """A ClearML task named after the output directory, the config as its hyperparameters; ``train/loss``
    is reported as title ``train``, series ``loss``. Offline mode writes a local session (ClearML's cache
    directory, ``offline/<task id>`` and a .zip of it) for ``clearml-task --import-offline-session``."""

    def __init__(self, cfg: RelaxConfig, output_dir: Path) -> None:
        Task = _require("clearml", "clearml").Task
        offline = cfg.run.clearml_offline
        _clearml_in_process(Task, offline)
        if offline:
            Task.set_offline(offline_mode=True)
        self.task = Task.init(
            project_name=cfg.run.clearml_project,
            task_name=run_name(output_dir),
            reuse_last_task_id=False,  # every run is a new task
            auto_connect_frameworks=False,  # we report the scalars; no second copy from TensorBoard
        )
        self.task.connect(public_config(cfg), name="relax")
        folder = self.task.get_offline_mode_folder() if offline else None
        self.offline_folder = Path(folder) if folder else None  # ClearML returns a pathlib2 path
        self._logger = self.task.get_logger()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for k, v in scalars(metrics).items():
            title, _, series = k.partition("/")
            self._logger.report_scalar(title=title, series=series, value=v, iteration=step)

    def close(self) -> None:
        self.task.close()


def _clearml_in_process(Task: Any, offline: bool) -> None:
    """Two ClearML defaults that do not fit a trainer (best effort: both are ClearML internals).

    On Linux ClearML reports through a process it forks from the caller; the trainer is a Ray actor holding
    gRPC and torch threads, where a fork is unsafe (and in offline mode ClearML 2.1's close() then waits
    ~10 s for a reporter that never ran), so report from a thread of this process instead. And an offline
    session should not ask updates.clear.ml for a newer release, which ClearML otherwise does even offline.
    """
    if hasattr(Task, "_report_subprocess_enabled"):
        Task._report_subprocess_enabled = False  # third-party: ClearML reads it only from clearml.conf
    if offline:
        try:
            from clearml.utilities.check_updates import CheckPackageUpdates

            CheckPackageUpdates._package_version_checked = True  # third-party: no switch for the check
        except (ImportError, AttributeError):  # pragma: no cover - another ClearML layout
            pass


def sink_names(cfg: RelaxConfig) -> list[str]:
    """The sinks the config asks for, in logging order (metrics.jsonl first)."""
    names = ["jsonl"]
    if cfg.run.tensorboard:
        names.append("tensorboard")
    if cfg.run.wandb_project:
        names.append("wandb")
    if cfg.run.clearml_project:
        names.append("clearml")
    return names


def build_sink(name: str, cfg: RelaxConfig, output_dir: Path) -> MetricsSink:
    """The sink registered as ``name`` in :data:`SINKS`, built for this run."""
    target: SinkFactory = SINKS.load(name)
    return target(cfg, Path(output_dir))


class MetricsService:
    """Fans every metrics dict out to its sinks; a failing sink is dropped, never the run."""

    def __init__(self, sinks: Mapping[str, MetricsSink]) -> None:
        self.sinks: dict[str, MetricsSink] = dict(sinks)

    @classmethod
    def from_config(cls, cfg: RelaxConfig, output_dir: str | Path) -> MetricsService:
        """Build the sinks ``cfg`` asks for, writing under ``output_dir``. A sink that cannot start (its
        library missing, a tracker refusing the run) raises here, before training, after closing the
        sinks already built."""
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        service = cls({})
        try:
            for name in sink_names(cfg):
                service.sinks[name] = build_sink(name, cfg, out)
        except BaseException:
            service.close()
            raise
        return service

    @property
    def names(self) -> list[str]:
        return list(self.sinks)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                sink.log(metrics, step)
            except Exception as e:
                self._drop(name, f"logging step {step}", e)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, {}
        for name, sink in sinks.items():
            try:
                sink.close()
            except Exception as e:
                logger.warning(
                    "metrics sink %r failed while closing: %s: %s", name, type(e).__name__, e, exc_info=e
                )

    def _drop(self, name: str, what: str, error: Exception) -> None:
        sink = self.sinks.pop(name)
        logger.warning(
            "metrics sink %r failed while %s and is dropped (the run and the other sinks go on): %s: %s",
            name,
            what,
            type(error).__name__,
            error,
            exc_info=error,
        )
        try:  # release what it holds (files, a tracker's background service); it is already reported
            sink.close()
        except Exception:
            logger.debug("closing the dropped metrics sink %r failed too", name, exc_info=True)

    def __enter__(self) -> MetricsService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
