"""Multimodal multi-turn RL: image observations (DeepEyes-style zoom) accumulate in an episode's media.

A scripted engine pins down the assembly (placeholders = features, ``mm_token_type_ids`` over the whole
trajectory, the loss mask on exactly the model's tokens); the real engine and trainer must agree on the
model tokens' log-probs with every image seen so far in the forward; the Controller runs the zoom
environment in both modes.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from _tiny import mm_task, run_flags

from relax_rollout.engines.base import GenerateOutput, SamplingParams
from relax_rollout.media_prompts import EpisodeMedia
from relax_rollout.multiturn import Episode, run_episodes

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

torch = pytest.importorskip("torch")

FAMILY = "qwen2_5_vl"
GUIDED = "relax_app.demo.envs:GuidedZoomEnv"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mmturn")


def _data(root):
    from relax_app.demo.mm_task import write_mm_dataset

    return str(write_mm_dataset(root / "image", n_per_task=4, seed=0, tasks=("image",)))


def _checkpoint(root, family):
    """A tiny Qwen-VL with its EOS logit raised (as test_multiturn's ``chatty``), so turns end early."""
    from relax_app.demo.mm_models import build_tiny_mm_model, extend_tokenizer
    from relax_app.demo.tokenizer import train_tokenizer

    out = root / f"ckpt-{family}"
    if (out / "config.json").exists():
        return str(out)
    torch.set_num_threads(1)
    texts = [
        "What colour is the shape? zoom: 0.25,0.25,0.75,0.75 The zoomed region.",
        "Answer: A",
        "Answer: B",
        "Answer: C",
        "Answer: D",
        "red green blue yellow error",
    ]
    base = train_tokenizer(texts * 20, vocab_size=300)
    n_text = len(base)
    tok = extend_tokenizer(base, family)
    model = build_tiny_mm_model(family, tok, seed=0)
    ids = torch.randint(3, n_text, (16, 12), generator=torch.Generator().manual_seed(0))  # no media tokens
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.text_config.hidden_size)
        h = h.mean(0)
        model.lm_head.weight[tok.eos_token_id] = 8.0 * h / h.dot(h)  # EOS logit ≈ 8: most steps
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return str(out)


@pytest.fixture(scope="module")
def data(root):
    return _data(root)


@pytest.fixture(scope="module")
def ckpt(root):
    return _checkpoint(root, FAMILY)


@pytest.fixture(scope="module")
def tok(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def rows(data):
    with open(data) as f:
        return [json.loads(line) for line in f]


class ScriptedEngine:
    """Says the given lines (canonical tokens + EOS); records the media it was given per call."""

    weight_version = 1

    def __init__(self, tok, lines):
        self.tok, self.lines, self.mm = tok, list(lines), []

    def generate(self, prompts, params, mm=None):
        self.mm.append(mm)
        line = self.lines[min(len(self.mm) - 1, len(self.lines) - 1)]
        ids = self.tok(line, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [GenerateOutput(ids, [-0.5] * len(ids), "stop", self.weight_version) for _ in prompts]


def _episode(tok, row, media, env_cls=None):
    from relax_app.demo.envs import ZoomEnv

    meta = {**row["metadata"], "media": {"image": [row["image"]]}}
    history = [{"role": "user", "content": row["prompt"]}]
    text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    ids, mm = media.encode(text, {"image": [row["image"]]}, keys=("image",))
    env = (env_cls or ZoomEnv)(row["prompt"], row["label"], meta)
    return Episode(env, history, list(ids), len(ids), mm=mm)


def _run(tok, engine, eps, media, budget=400, max_turns=5):
    return run_episodes(engine, tok, eps, SamplingParams(max_new_tokens=16), max_turns, budget, 5.0, media)


def test_image_observations_accumulate_and_line_up_with_the_trajectory(tok, rows):

    media = EpisodeMedia(FAMILY, tok, {"image_max_pixels": 64 * 64})
    lines = ["zoom: 0,0,0.5,0.5", "zoom: 2,0,1", "zoom: 0.5,0.5,1,1", f"Answer: {rows[0]['label']}"]
    engine = ScriptedEngine(tok, lines)
    [ep] = _run(tok, engine, [_episode(tok, rows[0], media)], media)
    assert ep.stop_reason == "env_done" and ep.turns == 4 and ep.info["reward"] == 1.0
    # every call saw all images so far: 1 (row), 2 (first zoom), 2 (the malformed zoom got text), 3
    grids = [len(call[0]["image_grid_thw"]) for call in engine.mm]
    pixels = [len(call[0]["pixel_values"]) for call in engine.mm]
    assert grids == [1, 2, 2, 3] and pixels[0] < pixels[1] == pixels[2] < pixels[3]
    assert len(ep.mm["image_grid_thw"]) == 3 and len(ep.mm["pixel_values"]) == pixels[-1]
    # placeholders in the trajectory = the features the vision tower makes (merge 2x2 patches per token)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    features = int(np.prod(ep.mm["image_grid_thw"], axis=1).sum()) // 4
    tokens, types = np.asarray(ep.tokens), np.asarray(ep.mm["mm_token_type_ids"])
    assert (tokens == image_id).sum() == features and len(types) == len(tokens)
    assert np.array_equal(types == 1, tokens == image_id)
    for call in engine.mm:  # what the engine got lined up with what it was asked to continue
        assert call[0]["mm_token_type_ids"].shape[0] <= len(tokens)
    # the loss mask covers exactly the model's tokens; the error and image observations are mask 0
    model = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in lines]
    resp, mask = ep.tokens[ep.prompt_len :], np.asarray(ep.mask)
    assert len(mask) == len(resp) == len(ep.log_probs)
    assert [t for t, m in zip(resp, mask) if m] == sum(model, [])
    assert not (types[ep.prompt_len :][mask > 0]).any()
    assert "error:" in tok.decode(resp) and resp[-len(model[-1]) :] == model[-1]


def test_media_that_do_not_fit_or_a_text_model_end_the_episode_cleanly(tok, rows):
    media = EpisodeMedia(FAMILY, tok, {"image_max_pixels": 64 * 64})
    ep0 = _episode(tok, rows[0], media)
    before = {k: v.copy() for k, v in ep0.mm.items()}
    [ep] = _run(tok, ScriptedEngine(tok, ["zoom: 0,0,0.5,0.5"]), [ep0], media, budget=12)
    assert ep.stop_reason == "token_budget" and len(ep.mm["image_grid_thw"]) == 1  # dropped whole
    assert len(ep.mm["mm_token_type_ids"]) == len(ep.tokens) and len(ep.mm["pixel_values"]) == len(
        before["pixel_values"]
    )
    [ep] = _run(tok, ScriptedEngine(tok, ["zoom: 0,0,0.5,0.5"]), [_episode(tok, rows[1], media)], None)
    assert ep.stop_reason == "env_invalid" and "text-only" in ep.info["error"]


def test_zoom_environment_passes_the_contract(rows):
    from PIL import Image

    from relax_app.demo.envs import ZoomEnv, parse_box
    from relax_core.env import as_messages, check_environment

    row = rows[0]

    def factory(prompt, label, metadata):
        return ZoomEnv(prompt, label, {**row["metadata"], "media": {"image": [row["image"]]}})

    t = check_environment(
        factory, row["prompt"], row["label"], ("zoom: 0.5,0,1,0.5", f"Answer: {row['label']}")
    )
    crop, done = t[0][1], t[0][2]
    assert isinstance(crop, Image.Image) and crop.size == (48, 48) and not done
    assert t[1][2] and t[1][3]["reward"] == 1.0
    [msg] = as_messages(factory("", row["label"], {}).format_observation(crop))
    assert msg["images"] == [crop] and "<image>" in msg["content"]
    for bad in ("1,2,3", "0.5,0,0.4,1", "a,b,c,d", "0,0,1.5,1"):
        with pytest.raises(ValueError):
            parse_box(bad)
    env = factory(row["prompt"], row["label"], {})
    assert [env.step("zoom: 0,0,1,1")[2]["zooms"] for _ in range(2)] == [1, 2]
    obs, done, info = env.step("zoom: 0,0")
    assert isinstance(obs, str) and obs.startswith("error:") and not done and info["zoom_errors"] == 1


class _ResetImageEnv:
    """Shows a zoomed image before the first turn (``reset``); every other one shows a missing file."""

    built = 0

    def __init__(self, prompt, label, metadata):
        from relax_app.demo.envs import ZoomEnv

        self.zoom = ZoomEnv(prompt, label, metadata)
        self.bad = _ResetImageEnv.built % 2 == 1
        _ResetImageEnv.built += 1

    def reset(self):
        return "/no/such/image.png" if self.bad else self.zoom.zoom((0, 0, 0.5, 0.5))

    def step(self, response):
        return self.zoom.step(response)

    def format_observation(self, obs):
        return [{"role": "user", "content": "A hint.", "images": [obs]}]  # no marker: one is prepended

    def close(self):
        pass


def test_row_and_reset_media_open_the_episode(ckpt, data, tmp_path, monkeypatch):
    """Episode mode takes the row's image (--multimodal-keys) and the reset observation's into the first
    prompt; a reset observation with unreadable media is recorded and the row's prompt used alone."""
    import sys
    import types

    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker

    torch.set_num_threads(1)
    mod = types.ModuleType("_mmturn_envs")
    mod.Env = _ResetImageEnv
    monkeypatch.setitem(sys.modules, "_mmturn_envs", mod)
    cfg = _cfg(
        ckpt,
        data,
        tmp_path,
        env_path="_mmturn_envs:Env",
        rollout_batch_size=4,
        n_samples_per_prompt=1,
        max_total_tokens=200,
    )
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, ckpt, data)
    worker.generation.engine = ScriptedEngine(worker.tokenizer, ["Answer: A"])
    worker.produce(0)
    b = bus.get("c", 4, timeout=5)
    image_id = worker.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    bad = 0
    for toks, m, plen, err, reason in zip(
        b.data["tokens"], b.data["mm"], b.data["prompt_len"], b.data["env_error"], b.data["finish_reason"]
    ):
        images = 1 if err else 2
        bad += bool(err)
        assert len(m["image_grid_thw"]) == images and len(m["mm_token_type_ids"]) == len(toks)
        assert (np.asarray(toks[:plen]) == image_id).sum() == (np.asarray(toks) == image_id).sum() > 0
        assert reason == ("env_error" if err else "env_done")
    assert bad == 2  # every other reset failed, the others opened with two images
    assert len(worker.generation.engine.mm[0]) == 4 and all(
        x is not None for x in worker.generation.engine.mm[0]
    )


ZOOM = dict(env_path=GUIDED, apply_chat_template=True, max_turns=3, max_total_tokens=80)
"""The guided zoom on the image task, chat-templated: episodes of up to 3 turns and 80 tokens."""
ZOOM_STEP = dict(rollout_batch_size=2, n_samples_per_prompt=3, rollout_max_response_len=6, micro_batch_size=6)
"""2 prompts x 3 episodes, at most 6 tokens a turn, trained as one micro-batch."""


def _cfg(ckpt, data, out, *mode, **flags):
    """A :data:`ZOOM` run of :data:`ZOOM_STEP`, ``flags`` over them (``run_flags``' keywords)."""
    from relax_app.cli_config import build_config
    from relax_core.controller import RunInputs

    argv = run_flags(RunInputs(ckpt, data), out, *mode, **{**mm_task("image"), **ZOOM, **ZOOM_STEP, **flags})
    return build_config(None, argv)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_model_tokens_log_probs_equal_the_trainers_with_image_observations(root, data, tmp_path, family):
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    ckpt = _checkpoint(root, family)
    cfg = _cfg(ckpt, data, tmp_path)
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, ckpt, data)
    worker.produce(0)
    b = bus.get("c", 6, timeout=5)
    grids = [len(m["image_grid_thw"]) for m in b.data["mm"]]
    assert max(grids) >= 2 and max(b.data["turns"]) >= 2  # episodes saw zoomed images
    image_id = worker.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for toks, m in zip(b.data["tokens"], b.data["mm"]):
        assert len(m["mm_token_type_ids"]) == len(toks)
        assert (np.asarray(toks) == image_id).sum() == int(np.prod(m["image_grid_thw"], axis=1).sum()) // 4
    lp = TorchBackend(cfg, ckpt, trainable=False).compute_log_probs(b.data)
    for mine, theirs, mask in zip(b.data["rollout_log_probs"], lp, b.data["loss_mask"]):
        on = mask > 0
        assert on.any()
        np.testing.assert_allclose(mine[on], theirs[on], atol=1e-4, rtol=0)


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode", [["--colocate"], ["--fully-async", "--max-staleness", "1"]], ids=["colocate", "async"]
)
def test_zoom_rl_runs_in_both_modes(ckpt, data, tmp_path, mode):
    from relax_core.controller import Controller, RunInputs

    cfg = _cfg(ckpt, data, tmp_path / "out", *mode, "--num-rollout", "3")
    result = Controller(cfg, RunInputs(ckpt, data, None)).run()
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["train/loss"]) for h in steps)
    stops = {k: v for k, v in result.rollout_stats.items() if k.startswith("stop/")}
    n = sum(stops.values())
    assert n >= 3 * cfg.samples_per_rollout and n % cfg.samples_per_rollout == 0
    assert not stops.get("stop/env_invalid") and not stops.get("stop/env_error")
    assert stops.get("stop/max_turns", 0) + stops.get("stop/token_budget", 0) > 0  # zoomed, went on
    assert result.rollout_stats.get("bad_media_rows", 0) == 0
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
