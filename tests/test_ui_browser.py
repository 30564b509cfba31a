"""`relax ui` in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium):
against a live fully-async run — a tiny Qwen3-VL on the image task, LoRA — then the same directory finished,
a PPO run's and the omni demo's (image, audio and video samples). Screenshots go to ``$RELAX_TEST_ARTIFACTS`` (else the test's temporary directory); with
``RELAX_README_SCREENSHOT=1`` the curves' one is written to ``docs/images/relax-ui.png`` (the README's).

Without Chromium the tests skip, unless ``RELAX_REQUIRE_BROWSER=1`` (CI installs it and sets that)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from itertools import groupby
from pathlib import Path

import pytest
from _tiny import ScriptedEngine, mm_checkpoint, mm_dataset, mm_task, run_flags

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        if os.environ.get("RELAX_REQUIRE_BROWSER") == "1":
            pytest.fail(
                "RELAX_REQUIRE_BROWSER=1 but chromium / chromedriver are not installed (.ci/run installs them)"
            )
        pytest.skip("no chromium + chromedriver here (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(driver), options=opts)
    yield d
    d.quit()


@pytest.fixture
def artifacts(tmp_path) -> Path:
    out = Path(os.environ.get("RELAX_TEST_ARTIFACTS") or tmp_path / "artifacts") / "ui"
    out.mkdir(parents=True, exist_ok=True)
    return out


def ui(run_dir: Path) -> tuple[str, object]:
    """`relax ui`'s app on ``run_dir``, served on 127.0.0.1 from a thread: (its URL, the server)."""
    from relax_app.ui.server import build_app
    from relax_rollout.http_api import Served

    s = Served(build_app(run_dir), "127.0.0.1", 0)
    threading.Thread(target=s.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{s.server_address[1]}/", s


def visit(d, url: str) -> None:
    """Open ``url`` in a clean slate: the console log emptied of what earlier pages wrote."""
    d.get("about:blank")
    d.get_log("browser")
    d.get(url)


def leave(d, server) -> None:
    """Stop ``server`` after the browser left its page (else the page's polls of it are console errors)."""
    d.get("about:blank")
    server.shutdown()


def wait(what, timeout_s: float = 60.0, every: float = 0.1):
    """``what()`` once it is truthy (its value), or an AssertionError after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s} s: {getattr(what, '__doc__', None) or what}")
        time.sleep(every)


def finished_steps(run_dir: Path) -> int:
    """Steps whose metrics line is complete in ``metrics.jsonl``."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return 0
    done = 0
    for line in text.splitlines():
        try:
            done = max(done, json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            pass
    return done


def chart_points(d, title: str) -> int:
    found = d.find_elements("css selector", f'svg[data-title="{title}"]')
    return int(found[0].get_attribute("data-points")) if found else 0


def open_last_step(d, url: str) -> None:
    """Load the page and open the samples of its last logged step."""
    visit(d, url)
    d.find_element("css selector", 'nav button[data-tab="samples"]').click()
    wait(lambda: d.find_elements("css selector", "#steps button[data-step]"), 15)[-1].click()


def console_errors(d) -> list[dict]:
    return [e for e in d.get_log("browser") if e["level"] == "SEVERE"]


def _train(out: Path, ckpt: str, data: str, *flags: str) -> subprocess.Popen:
    """`relax train` on the image task, 3 prompts x 2 samples a step, as a user starts it: its own process."""
    from relax_core.controller import RunInputs

    sizes = dict(rollout_batch_size=3, n_samples_per_prompt=2, micro_batch_size=6)
    argv = run_flags(RunInputs(ckpt, data), out, *flags, **mm_task("image"), **sizes)
    return subprocess.Popen(
        [sys.executable, "-m", "relax_app.cli", "train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_live_run_in_the_browser_then_the_same_directory_finished(browser, tmp_path, artifacts):
    """A fully-async LoRA run on images, watched live: the page loads with no console error, the reward curve
    holds one point per finished step, a new step shows within 5 s of its line being written, clicking a step
    lists its samples with each token's policy version, an image sample shows its image; once the run ended
    a new server on the directory (no state of its own) shows it whole."""
    d = browser
    ckpt, data = mm_checkpoint(tmp_path, "qwen3_vl"), mm_dataset(tmp_path, ("image",))
    out = tmp_path / "run"
    flags = ["--fully-async", "--max-staleness", "1", "--lora-rank", "4", "--num-rollout", "12"]
    run = _train(out, ckpt, data, *flags, "--reward-delay-s", "1")  # (a second a step at least: live a while)
    url, server = ui(out)
    try:
        visit(d, url)

        def two_steps() -> bool:
            """Two steps of the run finished (it must still be running until then)."""
            assert run.poll() is None or finished_steps(out) >= 2, run.communicate()[0][-3000:]
            return finished_steps(out) >= 2

        wait(two_steps, 300)
        # a new step: written at t (its line complete in metrics.jsonl), shown by the page within 5 s
        seen = finished_steps(out)
        wait(lambda: finished_steps(out) > seen, 120, every=0.02)
        step, t = finished_steps(out), time.monotonic()
        wait(lambda: int(d.find_element("id", "charts").get_attribute("data-last-step") or 0) >= step, 5.0)
        assert time.monotonic() - t < 5.0
        shown = int(d.find_element("id", "charts").get_attribute("data-last-step"))
        assert chart_points(d, "reward") == shown  # one point per finished step
        d.save_screenshot(str(artifacts / "live-curves.png"))
        _samples_of_a_step(d, artifacts, "live")
        assert console_errors(d) == []
        assert run.wait(timeout=600) == 0, run.stdout.read() if run.stdout else ""
    finally:
        if run.poll() is None:
            run.kill()
        leave(d, server)
    # the finished directory, through a new server
    url, server = ui(out)
    try:
        visit(d, url)
        wait(lambda: chart_points(d, "reward") == 12, 30)
        assert chart_points(d, "weight sync (MB)") == 12  # (LoRA: the adapters' bytes)
        _samples_of_a_step(d, artifacts, "finished")
        d.find_element("css selector", 'nav button[data-tab="timeline"]').click()
        wait(lambda: d.find_elements("css selector", "#lanes rect"), 15)
        d.save_screenshot(str(artifacts / "finished-timeline.png"))
        assert console_errors(d) == []
    finally:
        leave(d, server)


def _samples_of_a_step(d, artifacts: Path, name: str) -> None:
    """Click a logged step: its groups, every token's version, the image of an image sample."""
    d.find_element("css selector", 'nav button[data-tab="samples"]').click()
    button = wait(lambda: d.find_elements("css selector", "#steps button[data-step]"), 15)[-1]
    button.click()
    tokens = wait(lambda: d.find_elements("css selector", ".group .tok[data-version]"), 15)
    assert all(t.get_attribute("data-version").isdigit() for t in tokens)
    img = wait(lambda: d.find_elements("css selector", ".media img"), 15)[0]
    wait(lambda: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img), 15)
    d.save_screenshot(str(artifacts / f"{name}-samples.png"))
    d.find_element("css selector", 'nav button[data-tab="curves"]').click()
    if name == "live" and os.environ.get("RELAX_README_SCREENSHOT") == "1":
        d.save_screenshot(str(REPO / "docs" / "images" / "relax-ui.png"))


@pytest.mark.shared_ray
def test_a_ppo_run_shows_its_critic(browser, tiny_run_inputs, tmp_path, artifacts):
    """A finished PPO run (a critic, GAE): its critic curve is there, with every step."""
    from relax_app.cli_config import build_config
    from relax_core.controller import Controller

    out = tmp_path / "ppo"
    cfg = build_config(
        None, run_flags(tiny_run_inputs, out, "--colocate", num_rollout=3, advantage_estimator="gae")
    )
    Controller(cfg, tiny_run_inputs).run()
    url, server = ui(out)
    try:
        visit(browser, url)
        wait(lambda: chart_points(browser, "critic") == 3, 30)
        browser.save_screenshot(str(artifacts / "ppo-curves.png"))
        assert console_errors(browser) == []
    finally:
        leave(browser, server)


@pytest.mark.shared_ray
def test_the_omni_demo_shows_each_samples_image_audio_and_video(browser, tmp_path, artifacts):
    """A finished run of the omni demo's task (a tiny Qwen3-Omni thinker; image, video and audio questions in
    one batch): a step's samples show their image and hold their audio and video, each decoded by the browser
    (an image's width, a clip's duration), with no console error."""
    from relax_app.cli_config import build_config
    from relax_core.controller import Controller, RunInputs

    ckpt, data = mm_checkpoint(tmp_path, "qwen3_omni"), mm_dataset(tmp_path, ("image", "video", "audio"))
    out = tmp_path / "omni"
    sizes = dict(rollout_batch_size=3, n_samples_per_prompt=2, micro_batch_size=6, num_rollout=2)
    flags = run_flags(RunInputs(ckpt, data), out, "--colocate", "--no-rollout-shuffle", **mm_task(), **sizes)
    Controller(build_config(None, flags), RunInputs(ckpt, data, None)).run()
    url, server = ui(out)
    d = browser
    try:
        open_last_step(d, url)
        for kind in ("img", "audio", "video"):
            found = wait(lambda k=kind: d.find_elements("css selector", f".media {k}"), 15)[0]
            check = "naturalWidth > 0" if kind == "img" else "duration > 0"  # (its metadata read)
            wait(lambda c=check, e=found: d.execute_script(f"return arguments[0].{c}", e), 15)
        d.save_screenshot(str(artifacts / "omni-samples.png"))
        assert console_errors(d) == []
    finally:
        leave(d, server)


@pytest.mark.shared_ray
def test_a_tool_call_and_its_result_are_marked(browser, tiny_run_inputs, tmp_path):
    """A calculator episode as a trained sample (the model, scripted, calls the tool, reads its result,
    answers; the chat template's turns; the sample log's line): `relax ui` tells the call, the tool's result
    and the answer apart, and so does the page."""
    from relax_app.cli_config import build_config
    from relax_app.ui.data import RunView
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_core import sample_log
    from relax_rollout.worker import RolloutWorker

    calculator = dict(env_path="relax_app.demo.envs:CalculatorEnv", apply_chat_template=True)
    cfg = build_config(None, run_flags(tiny_run_inputs, tmp_path / "out", max_total_tokens=200, **calculator))
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, tiny_run_inputs.model_path, tiny_run_inputs.prompt_path)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+3"}}\n</tool_call>'
    worker.generation.engine = ScriptedEngine(worker.tokenizer, [call, "5"])
    worker.produce(0)
    batch = bus.get("c", 16, timeout=5)
    out = Path(cfg.run.output_dir)
    (out / "run.json").write_text(json.dumps({"model_path": tiny_run_inputs.model_path}))
    sample_log.step_path(out, 1).parent.mkdir(parents=True)
    lines = sample_log.lines(batch.data, 4)
    sample_log.step_path(out, 1).write_text("".join(json.dumps(r) + "\n" for r in lines))
    tokens = RunView(out).samples(1)["groups"][0]["samples"][0]["tokens"]
    parts = [(k, "".join(t["t"] for t in run)) for k, run in groupby(tokens, key=lambda t: t["k"])]
    assert [k for k, _ in parts] == ["call", "tool", "gen"], parts
    assert '"calc"' in parts[0][1] and "5" in parts[1][1] and parts[2][1].startswith("5")
    assert all(t["m"] == (t["k"] in ("gen", "call")) for t in tokens)
    url, server = ui(out)
    try:
        open_last_step(browser, url)
        first = wait(lambda: browser.find_elements("css selector", ".sample")[:1], 15)[0]
        shown = [t.get_attribute("data-kind") for t in first.find_elements("css selector", ".tok")]
        assert shown == [t["k"] for t in tokens]
        assert console_errors(browser) == []
    finally:
        leave(browser, server)
