"""A few real RL steps in each mode; asserts what flowed between the roles."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from _tiny import run_flags

from relax_app.cli_config import build_config
from relax_core.controller import Controller

pytestmark = pytest.mark.shared_ray  # (tests/conftest.py: one Ray cluster for the runs)

STEPS = 4


def _run(inputs, tmp_path, *flags, global_batch_size=8):
    """A run of STEPS steps with every role: two optimizer steps per batch, so ActorFwd runs too (with one,
    the default, π_prox comes from the training forward: ``global_batch_size=None``)."""
    argv = run_flags(
        inputs,
        tmp_path / "out",
        *flags,
        num_rollout=STEPS,
        eval_interval=2,
        kl_coef=0.01,
        verify_weight_sync=True,
        global_batch_size=global_batch_size,
    )
    cfg = build_config(None, argv)
    return cfg, Controller(cfg, inputs).run()


def _check_flow(cfg, result, max_staleness):
    spr = cfg.samples_per_rollout
    trained = result.audit["trained_ids"]
    assert len(trained) == STEPS * spr == len(set(trained))
    consumed = result.audit["consumed"]
    assert set(consumed) == {"advantages", "reference", "actor"} | (
        set() if cfg.prox_from_training_forward else {"actor_fwd"}
    )
    for name, ids in consumed.items():
        assert len(ids) == len(set(ids)), f"{name} consumed a sample twice"
        assert set(trained) <= set(ids), f"{name} missed a trained sample"
    assert sorted(consumed["actor"]) == sorted(trained)
    # rollout batches are put in step order, so the first STEPS batches are exactly what was trained
    assert sorted(trained) == sorted(consumed["advantages"])[: STEPS * spr]
    steps = [h for h in result.history if "train/loss" in h]
    assert len(steps) == STEPS
    for h in steps:
        assert math.isfinite(h["train/loss"]) and math.isfinite(h["train/grad_norm"])
        # bus/* metrics (logged before the step acks its batch: it acks after its checkpoint)
        assert h["bus/consumers/actor/delivered"] > 0 and "bus/depth/step0" not in h
        assert 0 <= h["train/staleness_max"] <= max_staleness
    assert max(result.bus_stats["staleness_hist"]) <= max_staleness
    # what reaches metrics.jsonl in either mode: the learning rate and the rollout's generation speed
    lines = (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()
    logged = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert len(logged) == STEPS
    assert all(r["train/lr"] == cfg.train.lr and r["rollout/tokens_per_s"] > 0 for r in logged)
    # the roofline (#51): model FLOPs by role (training is three passes of the Reference's forward, which
    # runs on every batch) and the step's and rollout's share of the machine's measured matmul peak
    for r in logged:
        passes = 3 * r["perf/forward_gflop"] / r["perf/train_gflop"]
        assert passes == pytest.approx(round(passes)) and round(passes) >= 1
        assert r["perf/rollout_gflop"] < r["perf/train_gflop"] / 3  # (a KV cache: causal pairs only)
        assert r["perf/train_mfu"] > 0 and r["perf/rollout_mfu"] > 0
    # the rollout engine held exactly the trainer's weights after every sync (version + checksum)
    trainer, rollout = result.audit["trainer_weights"], result.audit["rollout_weights"]
    assert sorted(trainer) == list(range(STEPS + 1))
    assert {v: rollout[v] for v in trainer} == trainer
    assert len(result.eval_curve) >= 2


@pytest.mark.integration
@pytest.mark.parametrize("lora", [[], ["--lora-rank", "4"]], ids=["full", "lora"])
def test_colocate_flow(tiny_run_inputs, tmp_path, lora):
    """Every role in one process. With LoRA (#37) the same flow: the Reference computes with the trainer's
    weights under the adapter switched off, ActorFwd with the trainer's own, and each sync carries the
    adapters alone, which the engine serves (the checksums above: trainer's adapter = engine's)."""
    cfg, result = _run(tiny_run_inputs, tmp_path, "--colocate", *lora)
    assert result.mode == "colocate"
    _check_flow(cfg, result, max_staleness=0)
    assert not any(s["name"] in TURNS for s in _spans(result))  # no --offload on a CPU machine by default
    synced = [h["perf/weight_sync_bytes"] for h in result.history if "train/loss" in h]
    from safetensors import safe_open

    with safe_open(str(Path(tiny_run_inputs.model_path) / "model.safetensors"), "pt") as f:
        full = sum(f.get_tensor(k).nbytes for k in f.keys())
    if lora:  # rank 4 adapters on the tiny model: a fraction of its weights
        assert all(0 < b < full / 3 for b in synced), (synced, full)
    else:
        assert all(b >= full for b in synced), (synced, full)


TURNS = {"offload", "onload", "release_memory", "resume_memory"}


def _spans(result) -> list[dict]:
    import json

    events = json.loads(Path(result.trace_path).read_text())["traceEvents"]
    roles = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    spans = [{**e, "role": roles[e["pid"]]} for e in events if e["ph"] == "X"]
    return sorted(spans, key=lambda e: e["ts"])


def _check_turns(result, roles_with_models: set[str]) -> None:
    """Walk the timeline: the engine generates only while every model role is offloaded and its own memory
    is held; the roles forward and train only while the engine's memory is released and theirs is back."""
    offloaded: set[str] = set()
    released = False
    counts = dict.fromkeys(["generate", "train", "forward"], 0)
    for e in _spans(result):
        name, role = e["name"], e["role"]
        if name == "offload":
            offloaded.add(role)
            assert e["args"]["bytes"] > 0
        elif name == "onload":
            offloaded.discard(role)
        elif name == "release_memory":
            released = True
        elif name == "resume_memory" and "kv_cache" in e["args"].get("tags", ""):
            released = False
        elif name == "generate":
            assert offloaded == roles_with_models and not released, e
        elif name in ("train", "forward"):
            assert not offloaded and released, e
        if name in counts:
            counts[name] += 1
    assert counts["generate"] >= STEPS and counts["train"] == STEPS and counts["forward"] >= STEPS


@pytest.mark.integration
def test_colocate_offload_takes_turns_and_trains_as_without(tiny_run_inputs, tmp_path):
    """``--offload`` (on by default with CUDA; forced here on CPU, where it runs the same code): the rollout
    engine and the trainer/reference hand the device to each other every step, and the run is the same
    run: the same samples, losses and weights as without offload."""
    cfg, result = _run(tiny_run_inputs, tmp_path / "offload", "--colocate", "--offload")
    _check_flow(cfg, result, max_staleness=0)
    _check_turns(result, {"actor", "reference"})  # (ActorFwd computes with the trainer's model)
    _, plain = _run(tiny_run_inputs, tmp_path / "plain", "--colocate")
    assert result.audit["trained_ids"] == plain.audit["trained_ids"]
    assert result.audit["trainer_weights"] == plain.audit["trainer_weights"]
    losses = [h["train/loss"] for h in result.history if "train/loss" in h]
    assert losses == [h["train/loss"] for h in plain.history if "train/loss" in h]


@pytest.mark.integration
def test_fully_async_flow(tiny_run_inputs, tmp_path):
    """Every role its own Ray actor, one step of staleness allowed, weights sent overlapped with the next
    step (the default) from the trainer's shared-memory buffers (``ipc``). The on-policy broadcast path
    runs in the megatron rank-group test below and the fault tests."""
    cfg, result = _run(
        tiny_run_inputs,
        tmp_path,
        "--fully-async",
        "--max-staleness",
        "1",
        "--weight-sync-transport",
        "ipc",
        global_batch_size=None,
    )
    assert result.mode == "fully_async" and cfg.algo.decoupled_ppo  # (on by default at staleness >= 1)
    _check_flow(cfg, result, max_staleness=1)
    # decoupled PPO's π_prox is the trainer's policy of each step: one optimizer step per batch, so it comes
    # from the training forward itself and no ActorFwd runs
    steps = [h for h in result.history if "train/loss" in h]
    assert all(h["train/prox_from_forward_frac"] == 1 and h["train/prox_gap_max"] == 0 for h in steps)
    # with one step of slack rollout really runs ahead: some trained samples are one version old
    assert any(h["train/staleness_max"] == 1 for h in result.history if "train/loss" in h)
    # #53: each step logs its sync's broadcast seconds and the engine's longest pause for an update (the
    # rollout's engine loaded versions as it generated), and `relax status` shows the last one
    assert all(h["perf/weight_sync_broadcast_s"] > 0 and "perf/weight_pause_s" in h for h in steps)
    assert any(h["perf/weight_pause_s"] > 0 for h in steps)
    from relax_app.watch import render
    from relax_core.live import read_status

    status = read_status(cfg.run.output_dir)
    assert status.weight_sync is not None and status.weight_sync.step == steps[-1]["step"]
    assert f"weight sync v{steps[-1]['step']}: " in render(status)
    # and the timeline shows it: every role worked, and two roles worked at the same time
    spans = _spans(result)
    assert {s["role"] for s in spans} == {"rollout", "reference", "advantages", "actor"}
    work = [s for s in spans if s["name"] in {"generate", "reward", "forward", "advantages", "train"}]
    assert any(
        a["role"] != b["role"] and a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
        for a in work
        for b in work
    ), "no two roles ever worked at the same time"


def _ppo_flags(inputs, out: Path, *extra: str) -> list[str]:
    """A 3-step colocate PPO run: one warm-up step, two critic passes per batch."""
    return run_flags(
        inputs,
        out,
        "--colocate",
        *extra,
        num_rollout=3,
        advantage_estimator="gae",
        critic_warmup=1,
        critic_epochs=2,
        rm_type="relax_testing:parity_reward",  # (an untrained model earns it about half the time)
        verify_weight_sync=True,
        trace=False,
    )


def _check_ppo_steps(steps: list[dict]) -> None:
    """The warm-up step trains no policy; the others train it, each after two critic passes."""
    assert len(steps) == 3 and steps[0]["train/critic_warmup"] == 1 and "train/loss" not in steps[0]
    for h in steps[1:]:
        assert math.isfinite(h["train/loss"]) and h["critic/optimizer_steps"] == 2
        assert h["critic/values_lag_max"] == 0  # colocate: valued by the critic of this very step
        assert math.isfinite(h["critic/value_loss"]) and -10 < h["critic/explained_variance"] <= 1
    assert steps[-1]["critic/version"] == 2  # (the update before it valued the last batch)


@pytest.mark.integration
def test_ppo_in_colocate_warms_the_critic_up_then_trains_the_policy(tiny_run_inputs, tmp_path):
    """--advantage-estimator gae (#39): the Critic values each batch and fits it (two passes here), the
    Advantages role runs GAE on its values, the trainer whitens and trains. In the warm-up step only the
    critic trains: the policy's weights stay as they were (the checksums), the version still counts."""
    argv = _ppo_flags(tiny_run_inputs, tmp_path / "out")
    result = Controller(build_config(None, argv), tiny_run_inputs).run()
    _check_ppo_steps([h for h in result.history if "perf/train_s" in h])
    weights = result.audit["trainer_weights"]
    assert weights[0] == weights[1] != weights[2] != weights[3]  # the warm-up step did not move the policy
    assert set(result.audit["consumed"]) == {"critic", "advantages", "actor"}


@pytest.mark.integration
def test_ppo_with_megatron_values_with_megatrons_trunk(tiny_run_inputs, tmp_path):
    """The same run on --train-backend megatron (gloo, one rank): the critic is megatron's trunk with a
    scalar head (its checkpoint says so). In a process of its own: a one-rank megatron run leaves this
    process's torch.distributed group behind, which the rank-group tests after it must not find."""
    import subprocess
    import sys

    out = tmp_path / "out"
    argv = _ppo_flags(tiny_run_inputs, out, "--train-backend", "megatron", "--save", str(tmp_path / "ckpt"))
    run = subprocess.run(
        [sys.executable, "-m", "relax_app.cli", "train", *argv], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    _check_ppo_steps([r for r in rows if "perf/train_s" in r])
    import torch

    state = torch.load(tmp_path / "ckpt" / "critic" / "step_000003" / "optimizer.pt", weights_only=False)
    assert state.get("backend") == "megatron"


TP2 = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"]


def _assert_same_first_step(result, ref) -> None:
    """Same seed and initial weights: the same prompts and rollouts in step 1 (on-policy, whatever the
    mode), so the same loss and gradient."""
    first = next(h for h in result.history if "train/loss" in h)
    first_ref = next(h for h in ref.history if "train/loss" in h)
    assert result.audit["trained_prompts"][0] == ref.audit["trained_prompts"][0]
    for key in ("train/loss", "train/grad_norm", "train/kl"):
        assert first[key] == pytest.approx(first_ref[key], rel=1e-3, abs=1e-6), key


@pytest.fixture(scope="module")
def kv2_torch_colocate(kv2_inputs, tmp_path_factory):
    """The torch backend's colocate run of the two-KV-head model: what the megatron runs are checked by."""
    return _run(kv2_inputs, tmp_path_factory.mktemp("torch_colocate"), "--colocate")[1]


@pytest.fixture(scope="module")
def kv2_inputs(tiny_run_inputs, tmp_path_factory):
    """The tiny run with a model of two KV heads: TP=2 splits them."""
    pytest.importorskip("megatron.core")
    import shutil

    import transformers

    model = tmp_path_factory.mktemp("kv2")
    cfg = transformers.AutoConfig.from_pretrained(tiny_run_inputs.model_path)
    cfg.num_key_value_heads = 2
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(model)
    for f in Path(tiny_run_inputs.model_path).iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy2(f, model / f.name)
    return dataclasses.replace(tiny_run_inputs, model_path=str(model))


@pytest.mark.integration
@pytest.mark.slow
def test_tensor_parallel_megatron_roles_run_as_rank_groups(kv2_inputs, kv2_torch_colocate, tmp_path):
    """``--train-backend megatron`` in a fully-async run with two ranks per role (``--actor-num-gpus-per-node
    2``; CPU processes here): the trainer, ActorFwd and the reference each run as a rank group with TP=2;
    every sample flowed through each role once, the rollout engine held exactly the trainer's weights
    (checksums over the HF-named tensors megatron exported) after every sync, and step 1 matches the torch
    backend's. The weights go as deltas (``--weight-sync-delta``, #53): bitwise the same (the checksums),
    fewer bytes on the wire than the versions weigh."""
    flags = ["--fully-async", "--max-staleness", "0", "--weight-sync-delta", *TP2]
    cfg, result = _run(kv2_inputs, tmp_path / "tp2", *flags)
    _check_flow(cfg, result, max_staleness=0)
    _assert_same_first_step(result, kv2_torch_colocate)
    steps = [h for h in result.history if "train/loss" in h]
    assert any(h["perf/weight_sync_sent_bytes"] < h["perf/weight_sync_bytes"] for h in steps)  # (fp32 here)


DP2_ZERO = ["--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--use-distributed-optimizer"]


@pytest.mark.shared_ray(False)  # (asserts the run stops the cluster it started)
@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("layout", [TP2, DP2_ZERO], ids=["tp2", "dp2-distributed-optimizer"])
def test_colocate_megatron_rank_group_with_offload(kv2_inputs, kv2_torch_colocate, tmp_path, layout):
    """The recipes' shape on CPU: colocate mode, a megatron trainer of two ranks (TP=2, or two
    data-parallel replicas with the AdamW moments sharded between them, as the Omni recipe; the controller
    starts a local Ray for rank 1), the reference built on the same ranks (megatron's parallel state is
    per process) and ActorFwd on the trainer's model, all handing the device to the rollout engine every
    step (--offload); step 1 matches the torch backend's colocate run."""
    import ray

    cfg, result = _run(kv2_inputs, tmp_path / "mg", "--colocate", "--offload", *layout)
    _check_flow(cfg, result, max_staleness=0)
    _check_turns(result, {"actor", "reference"})
    assert not ray.is_initialized()  # the run stopped the cluster it started, and with it rank 1
    _assert_same_first_step(result, kv2_torch_colocate)
