"""The metrics service: what each sink writes is read back from its own files (metrics.jsonl, TensorBoard
event files, the W&B offline run's transaction log, the ClearML offline session); a failing sink is dropped
with one warning; a missing library fails at start-up with the flag and the extra to install."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core import metrics as metrics_mod
from relax_core.config import RelaxConfig
from relax_core.metrics import SINKS, MetricsService, build_sink, public_config, run_name

STEPS = [
    {"step": 0, "eval/accuracy": 0.25, "time": 1000.0},
    {
        "step": 1,
        "rollout/reward_mean": 0.5,
        "train/loss": 1.25,
        "perf/train_s": 3.0,
        "bus/samples": 16,
        "rollout/note": "not a number",  # grouped but not numeric: jsonl only
        "time": 1001.0,
    },
    {"step": 2, "rollout/reward_mean": 0.75, "train/loss": 0.5, "perf/train_s": 2.5, "bus/samples": 32},
    {"step": 2, "eval/accuracy": 0.5, "time": 1003.0},  # eval after a train step, same step
]


def _expected() -> dict[str, dict[int, float]]:
    """tag -> {step: value}: what TensorBoard, W&B and ClearML must hold."""
    out: dict[str, dict[int, float]] = {}
    for m in STEPS:
        for k, v in m.items():
            if "/" in k and isinstance(v, (int, float)):
                out.setdefault(k, {})[m["step"]] = float(v)
    return out


def _cfg(out: Path, **run) -> RelaxConfig:
    return RelaxConfig.model_validate({"run": {"output_dir": str(out), "tensorboard": False, **run}})


def _assert_same(got: dict[str, dict[int, float]], expected: dict[str, dict[int, float]]) -> None:
    assert set(got) == set(expected)
    for tag, by_step in expected.items():
        assert got[tag] == pytest.approx(by_step), tag


def _log_all(service: MetricsService) -> None:
    for m in STEPS:
        service.log(m, m["step"])


class Recorder:
    def __init__(self, fail_log: bool = False, fail_close: bool = False) -> None:
        self.steps: list[int] = []
        self.closed = 0
        self.fail_log, self.fail_close = fail_log, fail_close

    def log(self, metrics, step):
        if self.fail_log:
            raise RuntimeError("tracker went away")
        self.steps.append(step)

    def close(self):
        self.closed += 1
        if self.fail_close:
            raise OSError("cannot flush")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection or name lookup that would leave this machine is refused and recorded."""
    attempts: list[object] = []
    local = ("127.0.0.1", "::1", "localhost")
    real_connect, real_gai = socket.socket.connect, socket.getaddrinfo

    def connect(self, address):
        if isinstance(address, tuple) and address[0] not in local:
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    def getaddrinfo(host, *args, **kw):
        if host not in local and host is not None:
            attempts.append(host)
            raise socket.gaierror(f"test: no network ({host})")
        return real_gai(host, *args, **kw)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


# -- jsonl and TensorBoard -------------------------------------------------------------------------------


def _tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_jsonl_and_tensorboard_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    with MetricsService.from_config(_cfg(out, tensorboard=True), out) as service:
        assert service.names == ["jsonl", "tensorboard"]
        _log_all(service)
        # flushed every call: both are readable before close
        assert len((out / "metrics.jsonl").read_text().splitlines()) == len(STEPS)
    assert service.names == []

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == STEPS  # the whole dict, non-numeric and ungrouped keys included

    _assert_same(_tensorboard_scalars(out / "tensorboard"), _expected())  # no step, time, rollout/note


TENSORBOARD_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = sys.modules["tensorflow"] = None  # importing either raises ImportError
from relax_core.config import RelaxConfig
from relax_core.metrics import MetricsService
out, steps = sys.argv[1], json.loads(sys.argv[2])
cfg = RelaxConfig.model_validate({"run": {"output_dir": out, "tensorboard": True}})
with MetricsService.from_config(cfg, out) as service:
    assert service.names == ["jsonl", "tensorboard"], service.names
    for m in steps:
        service.log(m, m["step"])
print(sorted(m for m in ("torch", "tensorflow") if sys.modules.get(m) is not None))
"""


def test_tensorboard_sink_needs_only_the_tensorboard_package(tmp_path):
    """Written in a process where torch and TensorFlow cannot be imported; read back with TensorBoard's own
    EventAccumulator here."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", TENSORBOARD_WITHOUT_TORCH, str(out), json.dumps(STEPS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    (event_file,) = (out / "tensorboard").glob("events.out.tfevents.*")
    _assert_same(_tensorboard_scalars(event_file.parent), _expected())


def test_two_tensorboard_sinks_of_one_process_write_two_files(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = _cfg(tmp_path, tensorboard=True)
    a, b = build_sink("tensorboard", cfg, tmp_path), build_sink("tensorboard", cfg, tmp_path)
    a.log({"train/loss": 1.0}, 0)
    b.log({"train/loss": 2.0}, 1)
    a.close(), b.close()
    a.close()  # a second close does nothing
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert _tensorboard_scalars(tmp_path / "tensorboard") == {"train/loss": {0: 1.0, 1: 2.0}}


def test_jsonl_appends_to_an_existing_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    with MetricsService.from_config(_cfg(tmp_path), tmp_path) as service:
        assert service.names == ["jsonl"]
        service.log({"step": 1, "train/loss": 2.0}, 1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1, "train/loss": 2.0}\n'


# -- Weights & Biases, offline -----------------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    home = tmp_path / "wandb-home"
    env = {
        "HOME": home,
        "WANDB_DIR": home / "dir",
        "WANDB_CACHE_DIR": home / "cache",
        "WANDB_CONFIG_DIR": home / "config",
        "WANDB_DATA_DIR": home / "data",
        "WANDB_ARTIFACT_DIR": home / "artifacts",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "WANDB_PROJECT", "WANDB_RUN_ID"):
        monkeypatch.delenv(k, raising=False)


def _wandb_records(run_file: Path) -> list[dict]:
    """The run's .wandb transaction log, record by record, read by wandb's own reader."""
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_wandb_offline_run_holds_the_logged_values(tmp_path, wandb_offline, no_network):
    out = tmp_path / "grpo-demo"
    cfg = _cfg(
        out,
        wandb_project="relax-test",
        notify_urls=["json://user:s3cret-token@hooks.example/x"],
    )
    service = MetricsService.from_config(cfg, out)
    try:
        assert service.names == ["jsonl", "wandb"]
        _log_all(service)
    finally:
        service.close()

    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((out / "wandb").iterdir())
    (run_file,) = runs[0].glob("run-*.wandb")
    records = _wandb_records(run_file)

    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "relax-test"
    assert run["display_name"] == "grpo-demo" == run_name(out)
    config = run["config"]["update"]
    assert config["run"]["output_dir"] == str(out)
    assert config["run"]["wandb_mode"] == "offline"
    assert config["run"]["notify_urls"] == ["json://..."]
    assert "s3cret" not in run_file.read_bytes().decode("latin-1")  # secrets never reach the tracker

    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r["type"] == "history":
            step = r["history"]["step"]["num"] if r["history"].get("step") else 0
            for k, v in r["history"]["item"].items():
                if not k.startswith("_"):
                    history.setdefault(k, {})[int(step)] = v
    _assert_same(history, _expected())
    assert any(r["type"] == "exit" for r in records)  # finished by close()


# -- ClearML, offline --------------------------------------------------------------------------------------


@pytest.fixture
def clearml_offline(tmp_path, monkeypatch, no_network):
    """ClearML's config, cache (where offline sessions go) and home (its session file) in tmp_path."""
    pytest.importorskip("clearml")
    home = tmp_path / "clearml-home"
    home.mkdir()
    conf = tmp_path / "clearml.conf"
    conf.write_text("")  # no server, no credentials
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("CLEARML_CONFIG_FILE", str(conf))
    monkeypatch.setenv("CLEARML_CACHE_DIR", str(tmp_path / "clearml-cache"))
    for k in ("CLEARML_API_HOST", "CLEARML_WEB_HOST", "CLEARML_FILES_HOST", "CLEARML_TASK_ID"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "clearml-cache" / "offline"


@pytest.mark.slow
def test_clearml_offline_session_holds_the_scalars(tmp_path, clearml_offline, no_network):
    out = tmp_path / "grpo-demo"
    cfg = _cfg(out, clearml_project="relax-test")
    cfg.rollout.elastic_token = "s3cret-token"
    service = MetricsService.from_config(cfg, out)
    try:
        assert service.names == ["jsonl", "clearml"]
        folder = service.sinks["clearml"].offline_folder
        _log_all(service)
    finally:
        service.close()

    assert no_network == []  # offline means offline: not even ClearML's update check
    assert folder.parent == clearml_offline and folder.is_dir()
    assert folder.with_suffix(".zip").is_file()  # what clearml-task --import-offline-session takes

    events = [
        e
        for line in (folder / "metrics.jsonl").read_text().splitlines()
        for e in json.loads(line)
        if e["type"] == "training_stats_scalar"
    ]
    got: dict[str, dict[int, float]] = {}
    for e in events:
        got.setdefault(f"{e['metric']}/{e['variant']}", {})[e["iter"]] = e["value"]
    _assert_same(got, _expected())

    task = json.loads((folder / "task.json").read_text())
    assert task["name"] == "grpo-demo"
    assert task["project_name"] == "relax-test"
    params = task["hyperparams"]["relax"]
    assert params["run/output_dir"]["value"] == str(out)
    assert params["rollout/elastic_token"]["value"] == "***"
    # (not the whole task.json: ClearML also stores the checkout's uncommitted git diff there)
    assert "s3cret" not in json.dumps(task["hyperparams"])


# -- failures ----------------------------------------------------------------------------------------------


def test_a_sink_raising_is_dropped_with_one_warning_and_the_others_go_on(tmp_path, caplog):
    service = MetricsService.from_config(_cfg(tmp_path), tmp_path)
    boom, after = Recorder(fail_log=True), Recorder()
    service.sinks.update(boom=boom, after=after)

    with caplog.at_level(logging.WARNING, logger="relax_core.metrics"):
        _log_all(service)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "'boom'" in warnings[0].getMessage() and "logging step 0" in warnings[0].getMessage()
    assert "tracker went away" in warnings[0].getMessage()
    assert service.names == ["jsonl", "after"]
    assert boom.closed == 1  # released when dropped
    assert after.steps == [m["step"] for m in STEPS]
    service.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == STEPS  # no line lost


def test_a_sink_raising_on_close_does_not_stop_the_others(tmp_path, caplog):
    service = MetricsService.from_config(_cfg(tmp_path), tmp_path)
    bad, good = Recorder(fail_close=True), Recorder()
    service.sinks.update(bad=bad, good=good)
    service.log({"step": 1, "train/loss": 1.0}, 1)
    with caplog.at_level(logging.WARNING, logger="relax_core.metrics"):
        service.close()
        service.close()  # a second close does nothing
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "'bad'" in warnings[0].getMessage()
    assert "closing" in warnings[0].getMessage()
    assert (bad.closed, good.closed) == (1, 1)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "train/loss": 1.0}\n'


@pytest.mark.parametrize(
    ("flags", "module", "message"),
    [
        ({"wandb_project": "p"}, "wandb", "--wandb-project needs wandb: pip install 'relax-core[wandb]'"),
        (
            {"clearml_project": "p"},
            "clearml",
            "--clearml-project needs clearml: pip install 'relax-core[clearml]'",
        ),
        (
            {"tensorboard": True},
            "tensorboard.compat.proto.event_pb2",  # the sink's first import
            '--tensorboard needs tensorboard: pip install "relax-core[tensorboard]"',
        ),
    ],
)
def test_a_missing_library_fails_at_start_up(tmp_path, monkeypatch, flags, module, message):
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    built: list[Recorder] = []

    def jsonl(cfg, out):
        built.append(Recorder())
        return built[-1]

    monkeypatch.setitem(SINKS, "jsonl", jsonl)
    with pytest.raises(ImportError) as err:
        MetricsService.from_config(_cfg(tmp_path, **flags), tmp_path)
    assert str(err.value).startswith(message)
    assert [r.closed for r in built] == [1]  # the sinks already started are closed


def test_registry_takes_module_class_or_factory(tmp_path, monkeypatch):
    monkeypatch.setitem(SINKS, "recorder", lambda cfg, out: Recorder())
    assert isinstance(build_sink("recorder", _cfg(tmp_path), tmp_path), Recorder)
    sink = build_sink("jsonl", _cfg(tmp_path), tmp_path)  # "relax_core.metrics:JsonlSink"
    assert isinstance(sink, metrics_mod.JsonlSink) and isinstance(sink, metrics_mod.MetricsSink)
    sink.close()
    with pytest.raises(ValueError, match="unknown metrics sink 'nope'"):
        build_sink("nope", _cfg(tmp_path), tmp_path)


def test_public_config_masks_secrets(tmp_path):
    cfg = _cfg(tmp_path, notify_urls=["slack://T/B/C", "json://u:p@h/x"])
    cfg.rollout.elastic_token = "tok"
    data = public_config(cfg)
    assert data["run"]["notify_urls"] == ["slack://...", "json://..."]
    assert data["rollout"]["elastic_token"] == "***"
    assert data["run"]["output_dir"] == str(tmp_path)
    assert cfg.run.notify_urls == ["slack://T/B/C", "json://u:p@h/x"]  # the config itself is untouched


def test_importing_the_module_imports_no_tracker_or_torch():
    code = (
        "import sys, relax_core.metrics; "
        "print([m for m in ('torch', 'wandb', 'clearml', 'tensorboard') if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert proc.stdout.strip() == "[]"
