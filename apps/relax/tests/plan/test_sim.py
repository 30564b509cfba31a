"""`relax plan`'s simulation (#57): the run's own policies on a virtual clock, the cost models, the CLI."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from relax_app.plan import plan_main
from relax_app.plan.config import load_plan
from relax_app.plan.report import colocate_of, phases, summarise
from relax_app.plan.sim import Simulation

EXAMPLES = Path(__file__).resolve().parents[2] / "src" / "relax_app" / "plan" / "examples"
SMALL = {
    "name": "small",
    "cluster": {"device": "H100-SXM", "rollout_gpus": 4, "train_gpus": 4},
    "model": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 32000,
    },
    "workload": {"prompts_per_step": 16, "samples_per_prompt": 4, "response": {"mean": 500, "max": 4000}},
}


def _plan(**run):
    from relax_app.plan.config import PlanConfig

    return PlanConfig.model_validate({**SMALL, "run": run})


def test_each_mode_runs_and_asynchrony_overlaps_rollout_with_training():
    colocate = summarise(Simulation(_plan(mode="colocate")).run())
    batch = summarise(Simulation(_plan(mode="fully_async", max_staleness=1)).run())
    stream = Simulation(
        _plan(mode="fully_async", max_staleness=1, streaming_rollout=True, partial_rollout=True)
    ).run()
    assert set(colocate.staleness) == {0}  # on-policy
    assert max(batch.staleness) == 1 and max(stream.staleness) <= 1  # the bound, from the real bus
    assert summarise(stream).samples_per_s > colocate.samples_per_s
    overlapped = any(  # some engine generates while the trainer trains
        a < t1 and t0 < b
        for e in stream.engines
        for a, b in e.busy
        for t0, t1, _ in stream.pools["train"].busy
    )
    assert overlapped


def test_streaming_at_staleness_two_completes_with_the_runs_bus():
    """The deadlock the simulator found (a bus of one step's size under streaming at staleness 2): the run's
    own bus config now holds every group in flight, so the simulated run completes every step."""
    o = Simulation(
        _plan(mode="fully_async", max_staleness=2, streaming_rollout=True, partial_rollout=True)
    ).run()
    assert len(o.step_ends) == 6 and max(o.staleness) <= 2


def test_lora_and_delta_sync_send_fewer_bytes_than_full():
    full = summarise(Simulation(_plan(mode="fully_async", max_staleness=1)).run()).sync_gb
    lora = summarise(Simulation(_plan(mode="fully_async", max_staleness=1, lora_rank=16)).run()).sync_gb
    delta = Simulation(_plan(mode="fully_async", max_staleness=1, weight_sync_delta=True)).run()
    sent = [n for *_, n in delta.syncs]
    assert lora < full / 10
    assert sent[0] / 1e9 == pytest.approx(full) and all(
        n < sent[0] / 5 for n in sent[1:]
    )  # full, then deltas


def test_the_baselines_own_settings_make_its_anchor_recompute_old_log_probs():
    """A publication's colocate baseline that ran otherwise (veRL's recomputes old log-probs; its async run
    takes the engines'): ``baseline_run`` applies to the anchor alone, so ActorFwd works only there."""
    from relax_app.plan.config import PlanConfig

    run = {"mode": "fully_async", "max_staleness": 1, "global_batch_size": 16, "use_actor_fwd": False}
    plan = PlanConfig.model_validate({**SMALL, "run": run, "baseline_run": {"use_actor_fwd": True}})
    anchor = colocate_of(plan)
    assert anchor.run["mode"] == "colocate" and anchor.run["use_actor_fwd"] is True
    assert phases(Simulation(anchor).run()).get("actor_fwd", 0) > 0
    assert "actor_fwd" not in phases(Simulation(plan).run())


def test_a_prompts_media_count_as_the_runs_preprocessing_counts_them():
    """Images and audio in tokens by relax_multimodal's own rules (Qwen3-Omni: 32x32 pixels a token, 13
    tokens an audio second, two markers each), added to the prompt: a longer prompt, a slower step."""
    from relax_app.plan.config import Media, PlanConfig

    assert Media(images=[(640, 360)]).tokens() == 20 * 11 + 2  # (360 rounds to 352 = 11 x 32)
    assert Media(audio_s=[10]).tokens() == 130 + 2
    with pytest.raises(ValueError, match="unknown model family 'gpt'"):
        Media(model="gpt")
    media = {"model": "qwen3_omni", "images": [[1280, 720]], "audio_s": [30]}
    plain = PlanConfig.model_validate({**SMALL, "run": {"mode": "colocate"}})
    rich = plain.model_copy(update={"workload": plain.workload.model_copy(update={"media": Media(**media)})})
    assert rich.workload.prompt_total == plain.workload.prompt_total + Media(**media).tokens()
    assert summarise(Simulation(rich).run()).step_s > summarise(Simulation(plain).run()).step_s


def test_the_128_gpu_example_plans_within_a_minute_with_a_split_and_a_picture(tmp_path, capsys):
    t0 = time.perf_counter()
    assert plan_main([str(EXAMPLES / "qwen3-8b-h100-128.yaml"), "--out", str(tmp_path)]) == 0
    assert time.perf_counter() - t0 < 60
    out = capsys.readouterr().out
    assert "recommended (fastest first" in out and "rollout 64 / train 64" in out and "idle rollout" in out
    assert "speed-up over colocate" in out
    assert (tmp_path / "qwen3-8b-h100-128-timeline.png").stat().st_size > 10_000


def test_bad_plans_are_refused_naming_the_file_and_the_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {rollout_gpus: 3, rollout_tp: 2}\nmodel: {hidden_size: 8}\n")
    assert plan_main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "rollout_tp" in err
    bad.write_text("cluster: {device: TPU}\nmodel: {}\n")
    assert plan_main([str(bad)]) == 2 and "H100-SXM" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mapping of sections"):
        bad.write_text("- a list")
        load_plan(bad)


def test_help_documents_every_section(capsys):
    with pytest.raises(SystemExit):
        plan_main(["--help"])
    out = capsys.readouterr().out
    sections = (
        "cluster.rollout_gpus",
        "workload.response.kind",
        "workload.media.audio_s",
        "efficiency.train_mfu",
    )
    for field in (*sections, "run (default", "baseline_run (default"):
        assert field in out, field
    assert "H100 datasheet" in out


def test_a_shipped_example_runs_by_name(tmp_path, capsys):
    args = ["relax-qwen3-4b-h800-8", "--out", str(tmp_path), "--no-recommend", "--steps", "3"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "published: 1.76x" in out and "speed-up over colocate" in out
