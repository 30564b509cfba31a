"""`relax ui`'s server over a real HTTP socket: run directories empty, half-written, of an older relax or
multimodal; each answered with what is there and what is missing, never a 500; the token when set."""

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from relax_app.ui.server import build_app
from relax_core import sample
from relax_core.sample_log import SampleLog
from relax_rollout.http_api import Served


@pytest.fixture
def serve():
    started = []

    def start(run_dir, token=None) -> str:
        s = Served(build_app(run_dir, token), "127.0.0.1", 0)
        threading.Thread(target=s.serve_forever, daemon=True).start()
        started.append(s)
        return f"http://127.0.0.1:{s.server_address[1]}"

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


def get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read()
            kind = r.headers.get("content-type", "")
            return r.status, json.loads(body) if "json" in kind else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _run_dir(root, *, samples=True, media=None):
    root.mkdir(parents=True, exist_ok=True)
    (root / "status.json").write_text(
        json.dumps({"state": "running", "step": 2, "num_steps": 5, "roles": {}})
    )
    data = {"prompt_data": str(root / "data.jsonl"), "multimodal_keys": {"image": "image"} if media else None}
    (root / "config.json").write_text(
        json.dumps({"run": {"mode": "fully_async", "max_staleness": 1}, "data": data})
    )
    (root / "run.json").write_text(json.dumps({"model_path": str(root / "no-model")}))
    rows = [
        {"step": 1, "rollout/reward_mean": 0.25, "time": 1.0},
        {"step": 2, "rollout/reward_mean": float("nan")},
    ]
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rollo')
    if media:
        (root / "data.jsonl").write_text(
            json.dumps({"prompt": "what is it?", "label": "A", "id": "r0", "image": media}) + "\n"
        )
    if samples:
        log = SampleLog(root, per_step=8)
        log.write(
            2,
            {
                sample.TOKENS: [np.arange(6)],
                sample.PROMPT_LEN: [4],
                sample.LOSS_MASK: [np.ones(2)],
                sample.ROLLOUT_LOG_PROBS: [np.array([-0.5, -0.2])],
                sample.LOG_PROBS: [np.array([-0.4, -0.2])],
                sample.GROUP_ID: ["1:0"],
                sample.REWARD: [1.0],
                sample.POLICY_VERSION: [1],
                sample.PROMPT_ID: ["r0"],
            },
        )
        log.close()
    return root


def test_an_empty_or_missing_directory_gets_a_page_saying_what_is_missing(serve, tmp_path):
    for run_dir, says in ((tmp_path, "is empty"), (tmp_path / "nope", "is not a directory")):
        url = serve(run_dir)
        status, page = get(url + "/")
        assert status == 200 and b"relax" in page
        status, run = get(url + "/api/run")
        assert status == 200 and any(says in p for p in run["problems"]), run
        assert get(url + "/api/metrics")[1] == [] and get(url + "/api/timeline")[0] == 200
        status, none = get(url + "/api/samples/1")
        assert status == 200 and none["groups"] == [] and "no samples of step 1" in none["problem"]


def test_a_half_written_run_of_an_older_relax(serve, tmp_path):
    root = _run_dir(tmp_path / "run", samples=False)
    (root / "trace.json").write_text('{"traceEv')  # (being written)
    url = serve(root)
    run = get(url + "/api/run")[1]
    assert any("samples/ has no step yet" in p for p in run["problems"]), run  # (running: not yet)
    assert run["settings"]["mode"] == "fully_async"
    (root / "status.json").write_text(json.dumps({"state": "done", "step": 2, "num_steps": 2}))
    assert any(
        "samples/ is missing" in p and "--log-samples 0" in p for p in get(url + "/api/run")[1]["problems"]
    )
    rows = get(url + "/api/metrics")[1]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["rollout/reward_mean"] is None  # (NaN: no JSON)
    assert [r["step"] for r in get(url + "/api/metrics?after=1")[1]] == [2]
    status, tl = get(url + "/api/timeline")
    assert status == 200 and tl["spans"] == [] and "trace.json cannot be read" in tl["problem"]
    (root / "status.json").write_text("{damaged")
    assert any("status.json cannot be read" in p for p in get(url + "/api/run")[1]["problems"])


def test_samples_tokens_versions_mismatch_and_an_image(serve, tmp_path):
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "red.png")
    url = serve(_run_dir(tmp_path / "run", media=str(tmp_path / "red.png")))
    got = get(url + "/api/samples/2")[1]
    (group,) = got["groups"]
    (s,) = group["samples"]
    assert [t["v"] for t in s["tokens"]] == [1, 1] and s["tokens"][0]["d"] == pytest.approx(0.1)
    assert "tokenizer could not be loaded" in got["problem"] and s["tokens"][0]["t"] == "#4"
    assert s["media"] == [{"kind": "image", "n": "0"}]
    status, png = get(url + "/api/media/r0/0")
    assert status == 200 and png[:4] == b"\x89PNG"
    assert get(url + "/api/media/r0/1")[0] == 404 and get(url + "/api/media/nope/0")[0] == 404


@pytest.mark.parametrize("path", ["/api/samples/x", "/api/metrics?after=-1", "/api/samples/99999999999999"])
def test_bad_parameters_are_a_400_naming_them(serve, tmp_path, path):
    status, body = get(serve(_run_dir(tmp_path / "run")) + path)
    assert status == 400 and ("step" in body["error"] or "after" in body["error"])


def test_a_token_guards_the_data_not_the_page(serve, tmp_path):
    url = serve(_run_dir(tmp_path / "run"), token="s3cret")
    assert get(url + "/")[0] == 200
    assert get(url + "/api/run")[0] == 401 and get(url + "/api/run?token=wrong")[0] == 401
    assert get(url + "/api/run?token=s3cret")[0] == 200


def test_the_timeline_places_the_health_managers_restarts_on_the_traces_clock(serve, tmp_path):
    root = _run_dir(tmp_path / "run")
    origin = 1_000_000_000_000_000_000
    trace = {
        "traceEvents": [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": "rollout"}},
            {"name": "generate", "ph": "X", "pid": 1, "tid": 0, "ts": 0.0, "dur": 2e6},
        ],
        "otherData": {"origin_unix_ns": origin},
    }
    (root / "trace.json").write_text(json.dumps(trace))
    event = {
        "role": "rollout",
        "reason": "killed",
        "action": "restart",
        "attempt": 1,
        "at": origin / 1e9 + 1.5,
    }
    status = {
        "state": "running",
        "step": 2,
        "num_steps": 5,
        "roles": {"rollout": {"restarts": 1}},
        "events": [event],
    }
    (root / "status.json").write_text(json.dumps(status))
    tl = get(serve(root) + "/api/timeline")[1]
    assert tl["spans"] == [{"role": "rollout", "name": "generate", "ts": 0.0, "dur": 2e6, "args": {}}]
    (ev,) = tl["events"]
    assert (
        ev["action"] == "restart"
        and ev["ts"] == pytest.approx(1.5e6)
        and tl["roles"]["rollout"]["restarts"] == 1
    )


def test_the_omni_demos_audio_and_video_are_served_as_such(serve, tmp_path):
    """A row with an image, a clip and a sound (the omni demo's media columns, several per row): each
    listed with its kind (the page plays audio and video in their own elements) and served with its type."""
    files = []
    for name, head in (("a.png", b"\x89PNG"), ("b.wav", b"RIFF"), ("c.mp4", b"\x00\x00\x00\x18ftyp")):
        (tmp_path / name).write_bytes(head + b"0" * 16)
        files.append(str(tmp_path / name))
    root = _run_dir(tmp_path / "run", media=files)
    url = serve(root)
    (s,) = get(url + "/api/samples/2")[1]["groups"][0]["samples"]
    assert [m["kind"] for m in s["media"]] == ["image", "audio", "video"]
    for k, kind in enumerate(("image/png", "audio/x-wav", "video/mp4")):
        with urllib.request.urlopen(f"{url}/api/media/r0/{k}", timeout=30) as r:
            assert r.status == 200 and r.headers["content-type"] == kind
