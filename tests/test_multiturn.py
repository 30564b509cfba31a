"""Agentic multi-turn rollout: exact token trajectories, loss masks, every way an episode ends.

A scripted engine (canned canonical replies) pins down the trajectory assembly against the chat template;
the real torch engine and trainer check log-prob agreement on the model's tokens; the Controller runs RL on
the calculator environment in both modes.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from _tiny import ScriptedEngine, run_flags

from relax_core.env import check_environment
from relax_rollout.engines.base import SamplingParams
from relax_rollout.multiturn import Episode, run_episodes

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)


@pytest.fixture(scope="module")
def tok(tiny_run_inputs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_run_inputs.model_path)


class Env:
    """Configurable test environment: answers ``n`` turns with an observation, then done (or misbehaves)."""

    def __init__(self, prompt, label, metadata):
        self.m, self.t, self.closed = metadata, 0, False

    def reset(self):
        if self.m.get("reset_raises"):
            raise RuntimeError("no sandbox")
        return None

    def step(self, response):
        self.t += 1
        bad = self.m.get("bad")
        if bad == "raise":
            raise ValueError("boom")
        if bad == "hang":
            time.sleep(5)
        if bad == "garbage":
            return "not a tuple"
        return (f"obs {self.t}", self.t >= self.m.get("turns", 2), {"reward": float(self.t)})

    def format_observation(self, obs):
        return [{"role": "user", "content": obs}]

    def close(self):
        self.closed = True


def _episodes(tok, n=1, prompt="3+4=", **meta):
    eps = []
    for _ in range(n):
        history = [{"role": "user", "content": prompt}]
        text = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        eps.append(Episode(Env(prompt, "7", meta), history, list(ids), len(ids)))
    return eps


def _run(tok, engine, eps, max_turns=5, budget=200, timeout=1.0):
    return run_episodes(engine, tok, eps, SamplingParams(max_new_tokens=8), max_turns, budget, timeout)


def test_trajectory_equals_the_template_rendering_and_masks_cover_the_model_tokens(tok):
    lines = ["calc 3+4", "7"]
    [ep] = _run(tok, ScriptedEngine(tok, lines), _episodes(tok, turns=2))
    assert ep.stop_reason == "env_done" and ep.turns == 2 and ep.env.closed
    convo = [
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": lines[0]},
        {"role": "user", "content": "obs 1"},
        {"role": "assistant", "content": lines[1]},
    ]
    rendered = tok(tok.apply_chat_template(convo, tokenize=False), add_special_tokens=False)["input_ids"]
    # the template ends a turn with EOS + "\n"; the trajectory stops at the model's EOS
    assert ep.tokens == rendered[: len(ep.tokens)] and len(rendered) - len(ep.tokens) <= 1
    model = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in lines]
    resp, mask = ep.tokens[ep.prompt_len :], np.asarray(ep.mask)
    assert len(mask) == len(resp) == len(ep.log_probs)
    assert [t for t, m in zip(resp, mask) if m] == model[0] + model[1]
    assert resp[: len(model[0])] == model[0] and resp[-len(model[1]) :] == model[1]  # env tokens in between
    assert all(lp == -0.5 for lp, m in zip(ep.log_probs, mask) if m) and all(
        lp == 0.0 for lp, m in zip(ep.log_probs, mask) if not m
    )


@pytest.mark.parametrize(
    "meta,engine_finish,max_turns,budget,reason",
    [
        ({"turns": 2}, "stop", 5, 200, "env_done"),
        ({"turns": 9}, "stop", 3, 200, "max_turns"),
        ({"turns": 9}, "stop", 9, 20, "token_budget"),
        ({"turns": 9}, "length", 5, 200, "engine_length"),
        ({"bad": "raise"}, "stop", 5, 200, "env_error"),
        ({"bad": "hang"}, "stop", 5, 200, "env_timeout"),
        ({"bad": "garbage"}, "stop", 5, 200, "env_invalid"),
    ],
)
def test_every_termination_path_is_recorded(tok, meta, engine_finish, max_turns, budget, reason):
    eps = _episodes(tok, n=2, **meta)
    t0 = time.monotonic()
    out = _run(tok, ScriptedEngine(tok, ["12"], finish=engine_finish), eps, max_turns, budget, timeout=0.5)
    assert [e.stop_reason for e in out] == [reason, reason]
    assert all(e.env.closed for e in out) and all(e.response_len <= budget for e in out)
    assert all(len(e.mask) == e.response_len == len(e.log_probs) for e in out)
    if reason == "max_turns":
        assert out[0].turns == max_turns
    if reason.startswith("env_") and reason != "env_done":
        assert out[0].info["error"] and out[0].turns == 1
    assert time.monotonic() - t0 < 5  # a hung environment costs its time-out, not the run


def test_a_broken_environment_ends_only_its_own_sample(tok):
    good, bad = _episodes(tok, turns=2), _episodes(tok, bad="raise")
    out = _run(tok, ScriptedEngine(tok, ["12"]), good + bad)
    assert [e.stop_reason for e in out] == ["env_done", "env_error"] and out[0].turns == 2


def test_calculator_environment_passes_the_contract():
    from relax_app.demo.envs import CalculatorEnv, safe_arith

    t = check_environment(CalculatorEnv, "3+4=", "7", responses=("calc: 3+4", "7"))
    assert t[0][1]["content"] == "7" and not t[0][2] and t[1][2] and t[1][3]["reward"] == 1.0
    for evil in ("__import__('os').system('x')", "2**99999999", "a+1", "1" * 100):
        with pytest.raises(ValueError):
            safe_arith(evil)


@pytest.fixture(scope="module")
def chatty(tiny_run_inputs, tmp_path_factory):
    """The tiny checkpoint with its EOS logit raised, so untrained turns end early and episodes have
    several turns (an untrained model almost never samples EOS within a few tokens)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("chatty")
    shutil.copytree(tiny_run_inputs.model_path, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        h = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        eos = model.config.eos_token_id
        model.lm_head.weight[eos] = (
            6.0 * h / h.dot(h)
        )  # EOS logit ≈ 6 vs ≈ 0 for the 300 others: ~half the steps
    model.save_pretrained(str(out))
    return str(out)


@pytest.mark.integration
def test_model_tokens_log_probs_equal_the_trainers(tiny_run_inputs, chatty, tmp_path):
    """Real engine, real trainer: on the model's tokens of multi-turn trajectories the rollout's log-probs
    equal the trainer's recomputation (the env tokens in between shift nothing)."""
    import torch

    from relax_app.cli_config import build_config
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker
    from relax_train.backends.torch_backend import TorchBackend

    torch.set_num_threads(1)
    cfg = build_config(
        None,
        _flags(tiny_run_inputs, tmp_path, max_turns=3, env_path=RETRY, hf_checkpoint=chatty),
    )
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, chatty, tiny_run_inputs.prompt_path)
    worker.produce(0)
    b = bus.get("c", 16, timeout=5)
    assert max(b.data["turns"]) >= 2  # some episodes really had several turns
    lp = TorchBackend(cfg, chatty, trainable=False).compute_log_probs(b.data)
    for mine, theirs, mask in zip(b.data["rollout_log_probs"], lp, b.data["loss_mask"]):
        on = mask > 0
        assert on.any() and (~on).any() or len(mask) == on.sum()
        np.testing.assert_allclose(mine[on], theirs[on], atol=1e-4, rtol=0)


RETRY = "relax_app.demo.envs:RetryEnv"


CALCULATOR = {
    "env_path": "relax_app.demo.envs:CalculatorEnv",
    "apply_chat_template": True,
    "max_total_tokens": 40,
}
"""The calculator environment, chat-templated, 40 tokens per episode."""


def _flags(inputs, tmp_path, *mode, **flags):
    """A tiny multi-turn run on :data:`CALCULATOR`, ``flags`` over it (``run_flags``' keywords)."""
    return run_flags(inputs, tmp_path / "out", *mode, **{**CALCULATOR, **flags})


@pytest.mark.integration
@pytest.mark.parametrize(
    "mode", [["--colocate"], ["--fully-async", "--max-staleness", "1"]], ids=["colocate", "async"]
)
def test_multi_turn_rl_runs_in_both_modes(tiny_run_inputs, chatty, tmp_path, mode):
    from relax_app.cli_config import build_config
    from relax_core.controller import Controller, RunInputs

    flags = _flags(
        tiny_run_inputs,
        tmp_path,
        *mode,
        num_rollout=3,
        env_path=RETRY,
        hf_checkpoint=chatty,
        max_turns=2,
        max_total_tokens=60,
    )
    cfg = build_config(None, flags)
    result = Controller(cfg, RunInputs(chatty, tiny_run_inputs.prompt_path, None)).run()
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == 3 and all(math.isfinite(h["train/loss"]) for h in steps)
    stops = {k: v for k, v in result.rollout_stats.items() if k.startswith("stop/")}
    n = sum(stops.values())  # every generated episode's end is recorded (async rollout may run ahead)
    assert n >= 3 * cfg.samples_per_rollout and n % cfg.samples_per_rollout == 0
    assert stops.get("stop/max_turns", 0) > 0  # wrong answers got more turns
    # metrics.jsonl: turns per episode and the episodes' end reasons of every trained batch
    lines = (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert len(logged) == 3
    for r in logged:
        assert 1 <= r["rollout/turns_mean"] <= 2 and r["rollout/tokens_per_s"] > 0
        ends = {k: v for k, v in r.items() if k.startswith("rollout/stop/")}
        assert sum(ends.values()) == cfg.samples_per_rollout, ends
        latency = [r[f"rollout/turn_s_p{q}"] for q in (50, 90, 95, 99)]  # (#55: per-turn latency)
        assert 0 < latency[0] <= latency[1] <= latency[2] <= latency[3], latency
    assert sum(r.get("rollout/stop/max_turns", 0) for r in logged) > 0
    # ... and what `relax watch` shows of them
    from relax_app.watch import render
    from relax_core.live import read_status

    status = read_status(Path(cfg.run.output_dir))
    assert status.agent is not None and status.agent.step == 3
    assert "episodes v3:" in render(status) and "turn s p50" in render(status)


def test_without_the_chat_template_the_first_prompt_is_the_single_turn_one(tiny_run_inputs, tmp_path):
    """A model warm-started on raw prompts sees its first turn exactly as in single-turn rollout."""
    from relax_app.cli_config import build_config
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker

    cfg = build_config(None, _flags(tiny_run_inputs, tmp_path, apply_chat_template=None))
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, tiny_run_inputs.model_path, tiny_run_inputs.prompt_path)
    worker.generation.engine = ScriptedEngine(worker.tokenizer, ["calc: 1+1", "2"])
    worker.produce(0)
    b = bus.get("c", 16, timeout=5)
    for tokens, plen, turns in zip(b.data["tokens"], b.data["prompt_len"], b.data["turns"]):
        text = worker.tokenizer.decode(tokens[:plen])
        assert "<|im_start|>" not in text and worker.prompts.encode(text) == list(tokens[:plen])
        assert turns == 2  # the calculator's result came back as a templated turn


def test_an_episode_starts_from_a_rows_chat_messages(tiny_run_inputs, tmp_path):
    """A dataset of chat messages (#50): the episode's first prompt is the chat template over the row's own
    turns, its system turn kept, and the environment is built with those messages."""
    import json

    from relax_app.cli_config import build_config
    from relax_app.demo.task import read_jsonl
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker

    rows = read_jsonl(tiny_run_inputs.prompt_path)
    data = tmp_path / "messages.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Add."},
                        {"role": "user", "content": r["prompt"]},
                    ],
                    "label": r["label"],
                }
            )
            + "\n"
            for r in rows
        )
    )
    flags = _flags(
        tiny_run_inputs, tmp_path, prompt_data=str(data), input_key="messages", apply_chat_template=None
    )
    cfg = build_config(None, flags)
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, tiny_run_inputs.model_path, str(data))
    worker.generation.engine = ScriptedEngine(worker.tokenizer, ["calc: 1+1", "2"])
    worker.produce(0)
    b = bus.get("c", 16, timeout=5)
    for tokens, plen in zip(b.data["tokens"], b.data["prompt_len"]):
        text = worker.tokenizer.decode(tokens[:plen])
        assert text.startswith("<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n"), text
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n"), text


def test_an_environment_that_cannot_be_built_ends_its_samples_not_the_run(tiny_run_inputs, tmp_path):
    """``relax_core.env:BrokenEnv`` takes no prompt/label, so building it per sample raises: each sample ends
    after its first turn as env_error with the reason, and the batch is still put on the bus."""
    from relax_app.cli_config import build_config
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker

    cfg = build_config(None, _flags(tiny_run_inputs, tmp_path, env_path="relax_core.env:BrokenEnv"))
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, tiny_run_inputs.model_path, tiny_run_inputs.prompt_path)
    worker.generation.engine = ScriptedEngine(worker.tokenizer, ["12"])
    worker.produce(0)
    b = bus.get("c", 16, timeout=5)
    assert b.data["finish_reason"] == ["env_error"] * 16 and b.data["turns"] == [1] * 16
    assert all("constructing the environment failed: TypeError" in e for e in b.data["env_error"])
    with pytest.raises(ValueError, match="cannot import"):  # a wrong path, though, is a config error
        bad = build_config(None, _flags(tiny_run_inputs, tmp_path, env_path="no_such_mod:Env"))
        RolloutWorker(bad, bus, tiny_run_inputs.model_path, tiny_run_inputs.prompt_path).produce(1)


class InfiniteRewardEnv:
    """One turn, then done with ``info["reward"] = +inf`` (a broken environment's reward)."""

    def __init__(self, prompt, label, metadata):
        pass

    def reset(self):
        return None

    def step(self, response):
        return ("", True, {"reward": float("inf")})

    def format_observation(self, obs):
        return [{"role": "user", "content": obs}]

    def close(self):
        pass


def test_an_environment_s_non_finite_reward_is_a_counted_bad_return(tiny_run_inputs, tmp_path):
    """Before: an environment's reward skipped the scorer's check; +inf reached the bus (the update was
    skipped, nothing counted, ``summary.json`` held ``Infinity``). Now it is checked where the environment
    made it and counted as the scorer counts a reward's bad return."""
    from relax_app.cli_config import build_config
    from relax_bus import BusConfig, ConsumerSpec, DataBus
    from relax_rollout.worker import RolloutWorker

    cfg = build_config(None, _flags(tiny_run_inputs, tmp_path, env_path=f"{__name__}:InfiniteRewardEnv"))
    bus = DataBus(BusConfig(consumers={"c": ConsumerSpec()}, capacity=100))
    worker = RolloutWorker(cfg, bus, tiny_run_inputs.model_path, tiny_run_inputs.prompt_path)
    worker.generation.engine = ScriptedEngine(worker.tokenizer, ["12"])
    worker.produce(0)
    b = bus.get("c", 16, timeout=5)
    assert b.data["reward"] == [0.0] * 16 and all(math.isfinite(r) for r in b.data["reward"])
    assert all(
        f.startswith("the environment's info['reward']: a reward score must be a finite")
        for f in b.data["reward_failure"]
    )
    assert worker.scorer.stats()["bad_return"] == 16
